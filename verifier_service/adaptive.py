"""Adaptive draft length: per sequence, the k that maximises expected tokens per unit cost.

With per-token acceptance alpha (i.i.d., the paper's simplification), a round with k drafts
emits E(k) = (1 - alpha^(k+1)) / (1 - alpha) tokens and costs 1 + c*k target-forward units,
c = (one draft step) / (one verification forward). Leviathan et al. (2023), section 3.3.
k = 0 (no speculation: 1 token per unit) wins when no k > 0 beats it.
"""

from __future__ import annotations

from dataclasses import dataclass


def expected_tokens(alpha: float, k: int) -> float:
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def best_k(alpha: float, cost_ratio: float, k_max: int) -> int:
    """argmax over k in [0, k_max] of E(k) / (1 + c k); ties go to the smaller k."""
    best, best_rate = 0, 1.0
    for k in range(1, k_max + 1):
        rate = expected_tokens(alpha, k) / (1.0 + cost_ratio * k)
        if rate > best_rate + 1e-9:
            best, best_rate = k, rate
    return best


@dataclass
class AcceptanceEstimate:
    """Decayed estimate of per-token acceptance from rounds (a accepted of k drafted):
    a successes, plus one failure when the round stopped at a rejection (a < k)."""

    successes: float = 3.0  # prior: alpha = 0.75 worth 4 trials
    trials: float = 4.0
    decay: float = 0.9  # per round

    def record(self, k: int, accepted: int) -> None:
        if k <= 0:
            return
        self.successes = self.successes * self.decay + accepted
        self.trials = self.trials * self.decay + accepted + (1 if accepted < k else 0)

    @property
    def alpha(self) -> float:
        return self.successes / self.trials


@dataclass
class CostRatio:
    """Measured c: seconds per draft step / seconds per verification forward (EMA)."""

    value: float = 0.4
    weight: float = 0.2

    def record(self, draft_s: float, draft_steps: int, forward_s: float) -> None:
        if draft_steps > 0 and forward_s > 0:
            sample = (draft_s / draft_steps) / forward_s
            self.value += self.weight * (sample - self.value)
