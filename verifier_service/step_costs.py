"""What a whole decode step costs, measured as the engine ran it, by (sequences, k).

A step's seconds from the drafter round to the last commit: the drafts, the forward with
any tree leaves, verification. The speculation controller (verifier_service/controller.py)
compares these directly, rather than adding up component costs: the components missed the
tree leaves a small batch verifies beside its chain (a 2-draft step fed 4.5 rows, not 3)
and what the drafter's catch-up and round trip cost (BENCHMARKS.md section 19).
"""

from __future__ import annotations


class StepCosts:
    """Seconds per decode step by (sequences in the step, most drafts of any of them): an
    EMA per cell with its sample count. Between two measured drafting k of the same batch
    size the estimate is linear; elsewhere it is unknown (None) and the caller falls back."""

    def __init__(self, weight: float = 0.1):
        self.weight = weight
        self._cells: dict[tuple[int, int], tuple[float, int]] = {}

    def record(self, sequences: int, k: int, seconds: float) -> None:
        if sequences <= 0 or k < 0 or not seconds > 0:
            return
        old = self._cells.get((sequences, k))
        if old is None:
            self._cells[(sequences, k)] = (seconds, 1)
        else:
            value, n = old
            self._cells[(sequences, k)] = (value + self.weight * (seconds - value), n + 1)

    def samples(self, sequences: int, k: int) -> int:
        return self._cells.get((sequences, k), (0.0, 0))[1]

    def __call__(self, sequences: int, k: int) -> float | None:
        cell = self._cells.get((sequences, k))
        if cell is not None:
            return cell[0]
        # drafting steps only: plain (k = 0) has no drafter round, whose fixed part (the
        # round trip, the tree leaves) makes k = 1 cost far more than halfway to k = 2
        ks = sorted(j for b, j in self._cells if b == sequences and j > 0)
        below = [j for j in ks if j < k]
        above = [j for j in ks if j > k]
        if not below or not above:
            return None
        lo, hi = below[-1], above[0]
        f = (k - lo) / (hi - lo)
        return self._cells[(sequences, lo)][0] * (1 - f) + self._cells[(sequences, hi)][0] * f

    def measured(self) -> dict[tuple[int, int], float]:
        return {key: value for key, (value, _) in self._cells.items()}
