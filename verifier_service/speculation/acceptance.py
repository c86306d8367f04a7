"""How often drafts are accepted, by draft position, as decayed counts (one sequence's, or
one route's in verifier_service/speculation/route_acceptance.py), and the tokens a round of k drafts
is expected to emit from them."""

from __future__ import annotations

from dataclasses import dataclass, field


def expected_tokens(accept: list[float], k: int) -> float:
    """E(k) = 1 + sum_{j<=k} prod_{i<=j} a_i: the bonus/recovered token plus each draft
    position reached and accepted (a position past the measured ones repeats the last)."""
    return expected_table(accept, k)[k]


def expected_table(accept: list[float], k: int) -> list[float]:
    """[E(0), E(1), ..., E(k)] (`expected_tokens`) in one pass."""
    out, p = [1.0], 1.0
    for j in range(k):
        p *= accept[min(j, len(accept) - 1)] if accept else 0.0
        out.append(out[-1] + p)
    return out


@dataclass
class PositionAcceptance:
    """Acceptance by draft position as decayed counts: `trials[i]` rounds reached position
    i, `hits[i]` accepted it. `decay(f)` multiplies every count by f (0 < f <= 1)."""

    trials: list[float] = field(default_factory=list)
    hits: list[float] = field(default_factory=list)

    def record(self, k: int, accepted: int) -> None:
        """A round of k drafts, `accepted` of them: positions up to the first rejected
        one were tried (none past k)."""
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
        """Per position: (hits + strength * prior) / (trials + strength); past the end of
        `prior`, a position's prior is the rate estimated for the one before it."""
        n = max(len(prior), len(self.trials))
        out: list[float] = []
        for i in range(n):
            p = prior[i] if i < len(prior) else out[-1]
            t = self.trials[i] if i < len(self.trials) else 0.0
            h = self.hits[i] if i < len(self.hits) else 0.0
            out.append((h + strength * p) / (t + strength))
        return out

    @property
    def drafted(self) -> float:
        return sum(self.trials)
