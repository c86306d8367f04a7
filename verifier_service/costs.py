"""What steps cost, measured online: seconds by size (rows of a forward, sequences in a
drafter round) for the speculation controller (verifier_service/controller.py)."""

from __future__ import annotations

from bisect import bisect_left


class CostCurve:
    """Seconds per event by size (rows of a forward, or sequences in a drafter round), an
    EMA per size. Unmeasured sizes interpolate between measured neighbours; past the
    largest measured size the curve is flat, an optimistic guess on a memory-bound device
    that the first such step corrects."""

    def __init__(self, prior: dict[int, float] | None = None, weight: float = 0.3):
        self.weight = weight
        self._by_size: dict[int, float] = dict(prior or {})
        self._sizes = sorted(self._by_size)

    def record(self, size: int, seconds: float) -> None:
        if size <= 0 or not seconds > 0:
            return
        old = self._by_size.get(size)
        if old is None:
            self._by_size[size] = seconds
            self._sizes = sorted(self._by_size)
        else:
            self._by_size[size] = old + self.weight * (seconds - old)

    def __call__(self, size: int) -> float | None:
        sizes = self._sizes
        if not sizes:
            return None
        i = bisect_left(sizes, size)
        if i < len(sizes) and sizes[i] == size:
            return self._by_size[size]
        if i == 0:
            return self._by_size[sizes[0]]
        if i == len(sizes):
            return self._by_size[sizes[-1]]
        lo, hi = sizes[i - 1], sizes[i]
        f = (size - lo) / (hi - lo)
        return self._by_size[lo] * (1 - f) + self._by_size[hi] * f

    def measured(self) -> dict[int, float]:
        return dict(self._by_size)
