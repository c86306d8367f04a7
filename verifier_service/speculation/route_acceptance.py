"""Acceptance by draft position per route, decayed with wall-clock time so an old burst
stops counting (the speculation controller's estimates: a route that
accepted badly once is not off for good)."""

from __future__ import annotations

import math
import time

from specd.speculation_config import SpeculationConfig
from verifier_service.speculation.acceptance import PositionAcceptance


class RouteAcceptance:
    """Per route, acceptance by position over two memories of the same rounds, both
    decayed with wall-clock time (half-life `half_life_s`) so an old burst stops counting
    and the estimate returns to the prior: a short one, never worth more than
    `max_rounds` rounds, and a long one of `long_rounds`. A route's estimate is, per
    position, the long one's, or the short one's where that is higher by more than `z`
    of its standard errors. A position no round reaches any more returns toward the one
    before it (its prior): its counts halve with time and shrink as each round past a
    memory's bound scales every position down, while the rounds that go on add to those
    before it.

    Why two: drafting stops on a bad streak, so the last rounds before a route goes plain
    are its worst; the long memory holds its level through them. After a real burst the
    long memory is all burst, and the short one shows within a few probes that it ended.
    Not simply the higher of the two: six accepted rounds in a row happen at 0.8, and on
    such luck k flips (docs/benchmarks-log.md sections 37-38)."""

    def __init__(self, config: SpeculationConfig | None = None, clock=time.monotonic):
        c = config or SpeculationConfig()
        self.z = c.route_z
        self.half_life_s = c.route_half_life_s
        self.max_rounds = c.route_short_rounds
        self.long_rounds = c.route_long_rounds
        self.clock = clock
        self._short: dict[str, PositionAcceptance] = {}
        self._long: dict[str, PositionAcceptance] = {}
        self._stamp: dict[str, float] = {}
        self._overall: dict[str, list[float]] = {}  # decayed [drafted, accepted]

    def _aged(self, route: str) -> tuple[PositionAcceptance, PositionAcceptance]:
        now = self.clock()
        short = self._short.setdefault(route, PositionAcceptance())
        long = self._long.setdefault(route, PositionAcceptance())
        last = self._stamp.get(route, now)
        if now > last:
            factor = 0.5 ** ((now - last) / self.half_life_s)
            short.decay(factor)
            long.decay(factor)
            self._overall[route] = [x * factor for x in self._overall.get(route, [0.0, 0.0])]
        self._stamp[route] = now
        return short, long

    def record(self, route: str, k: int, accepted: int, drafted: int | None = None) -> None:
        """A round planned at k drafts (positions), of which `drafted` came (default k: the
        load report's accepted / drafted counts those)."""
        if k <= 0:
            return
        short, long = self._aged(route)
        for memory, rounds in ((short, self.max_rounds), (long, self.long_rounds)):
            memory.record(k, accepted)
            memory.limit(rounds)
        d, a = self._overall.get(route, [0.0, 0.0])
        self._overall[route] = [d + (k if drafted is None else drafted), a + accepted]

    def positions(self, route: str) -> PositionAcceptance:
        """The short memory's counts."""
        return self._aged(route)[0]

    def estimate(self, route: str, prior: list[float], strength: float) -> list[float]:
        """a_i by position over `prior` (weighing `strength` rounds): the long memory's
        rate, or the short one's where it is higher by more than `z` of its standard
        errors (a route that came back from a burst)."""
        short, long = self._aged(route)
        rates = zip(short.rates(prior, strength), long.rates(prior, strength), strict=True)
        out = []
        # both memories record the same rounds, so they hold the same positions
        for i, (s, g) in enumerate(rates):
            rounds = (short.trials[i] if i < len(short.trials) else 0.0) + strength
            out.append(s if s - g > self.z * math.sqrt(s * (1 - s) / rounds) else g)
        return out

    def upper(self, route: str, first: float, strength: float) -> float:
        """a_1's upper bound: the Wilson score bound, at `z` standard errors, of `first`
        (its `estimate`, as the plan read it) over the rounds the long memory holds and the
        prior's `strength`. A route is known to accept under a floor only where this is
        under it: one rejected round on a route with nothing in memory says little
        (docs/benchmarks-log.md section 138)."""
        a, long = first, self._long.get(route)
        n = (long.trials[0] if long is not None and long.trials else 0.0) + strength
        z2 = self.z * self.z
        spread = self.z * math.sqrt(a * (1 - a) / n + z2 / (4 * n * n))
        return (a + z2 / (2 * n) + spread) / (1 + z2 / n)

    def rates(self) -> dict[str, float]:
        """accepted / drafted per route with rounds in memory (for load reports)."""
        out = {}
        for route in list(self._short):
            self._aged(route)
            d, a = self._overall.get(route, [0.0, 0.0])
            if d > 1e-3:
                out[route] = a / d
        return out
