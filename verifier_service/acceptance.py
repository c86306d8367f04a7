"""How often drafts are accepted, by draft position: per sequence and per route, decayed
with time so an old burst stops counting (the speculation controller's estimates)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


def expected_tokens(accept: list[float], k: int) -> float:
    """E(k) = 1 + sum_{j<=k} prod_{i<=j} a_i: the bonus/recovered token plus each draft
    position reached and accepted (a position past the measured ones repeats the last)."""
    total, p = 1.0, 1.0
    for j in range(k):
        p *= accept[min(j, len(accept) - 1)] if accept else 0.0
        total += p
    return total


@dataclass
class PositionAcceptance:
    """Acceptance by draft position as decayed counts: `trials[i]` rounds reached position
    i, `hits[i]` accepted it. `decay(f)` multiplies every count by f (0 < f <= 1)."""

    trials: list[float] = field(default_factory=list)
    hits: list[float] = field(default_factory=list)

    def record(self, k: int, accepted: int) -> None:
        if k <= 0:
            return
        reached = min(accepted + 1, k)  # positions 0..accepted were tried (not past k)
        grow = reached - len(self.trials)
        if grow > 0:
            self.trials += [0.0] * grow
            self.hits += [0.0] * grow
        for i in range(reached):
            self.trials[i] += 1
            self.hits[i] += i < accepted

    def limit(self, max_trials: float) -> None:
        """Scale the counts down so position 0 holds at most `max_trials` rounds."""
        if self.trials and self.trials[0] > max_trials:
            self.decay(max_trials / self.trials[0])

    def decay(self, factor: float) -> None:
        self.trials = [t * factor for t in self.trials]
        self.hits = [h * factor for h in self.hits]

    def rates(self, prior: list[float], strength: float) -> list[float]:
        """Per position: (hits + strength * prior) / (trials + strength)."""
        n = max(len(prior), len(self.trials))
        out = []
        for i in range(n):
            p = prior[min(i, len(prior) - 1)]
            t = self.trials[i] if i < len(self.trials) else 0.0
            h = self.hits[i] if i < len(self.hits) else 0.0
            out.append((h + strength * p) / (t + strength))
        return out

    @property
    def drafted(self) -> float:
        return sum(self.trials)


class RouteAcceptance:
    """Per route, acceptance by position, decayed with wall-clock time (half-life
    `half_life_s`) so an old burst stops counting and the estimate returns to the prior, and
    never worth more than `max_rounds` rounds, so new rounds move it within a request or
    two."""

    def __init__(self, half_life_s: float = 30.0, max_rounds: float = 16.0, clock=time.monotonic):
        self.half_life_s = half_life_s
        self.max_rounds = max_rounds
        self.clock = clock
        self._routes: dict[str, PositionAcceptance] = {}
        self._stamp: dict[str, float] = {}
        self._overall: dict[str, list[float]] = {}  # decayed [drafted, accepted]

    def _aged(self, route: str) -> PositionAcceptance:
        now = self.clock()
        acc = self._routes.setdefault(route, PositionAcceptance())
        last = self._stamp.get(route, now)
        if now > last:
            factor = 0.5 ** ((now - last) / self.half_life_s)
            acc.decay(factor)
            self._overall[route] = [x * factor for x in self._overall.get(route, [0.0, 0.0])]
        self._stamp[route] = now
        return acc

    def record(self, route: str, k: int, accepted: int) -> None:
        if k <= 0:
            return
        acc = self._aged(route)
        acc.record(k, accepted)
        acc.limit(self.max_rounds)
        d, a = self._overall.get(route, [0.0, 0.0])
        self._overall[route] = [d + k, a + accepted]

    def positions(self, route: str) -> PositionAcceptance:
        return self._aged(route)

    def rates(self) -> dict[str, float]:
        """accepted / drafted per route with rounds in memory (for load reports)."""
        out = {}
        for route in list(self._routes):
            self._aged(route)
            d, a = self._overall.get(route, [0.0, 0.0])
            if d > 1e-3:
                out[route] = a / d
        return out
