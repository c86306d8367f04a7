"""Dequantised embedding rows of the tokens a model saw lately.

A decode step feeds one or two tokens a sequence, and a quantised embedding gives up a
row only by dequantising (the tile that holds it, at 6 and 8 bits): ~0.2 ms a forward on
the AVX2 CPU of docs/benchmarks-log.md section 42, every draft and every step. Text repeats its
tokens, so rows kept from earlier forwards answer most lookups. The rows are the ones the
weight would give (dequantising is element-wise), so outputs cannot change.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

CAPACITY = 2048  # rows kept (the 1.5B's at fp32: 12 MB)
SMALL = 16  # a forward feeding more tokens (a prompt) dequantises them all at once


class RowCache:
    def __init__(self, weight, dtype: torch.dtype, capacity: int = CAPACITY):
        self.weight, self.dtype, self.capacity = weight, dtype, capacity
        self._rows: OrderedDict[int, torch.Tensor] = OrderedDict()

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] -> rows [T, H] in `dtype`."""
        if len(ids) > SMALL:  # a prompt: its rows at once, and kept, as its text recurs
            rows = self.weight.rows(ids, self.dtype)
            self._keep(ids.tolist(), rows)
            return rows
        wanted = ids.tolist()
        missing = [t for t in dict.fromkeys(wanted) if t not in self._rows]
        if missing:
            fresh = self.weight.rows(torch.tensor(missing, device=ids.device), self.dtype)
            for t, row in zip(missing, fresh, strict=True):
                self._rows[t] = row.clone()  # its own storage: `fresh` is not kept alive
        for t in wanted:
            self._rows.move_to_end(t)
        self._evict()
        return torch.stack([self._rows[t] for t in wanted])

    def _keep(self, ids: list[int], rows: torch.Tensor) -> None:
        """Keep a prompt's rows, its last tokens the most recent (decoding goes on from
        them); at most `capacity` of them."""
        last = {t: i for i, t in enumerate(ids)}  # each token at its last position
        for t, i in sorted(last.items(), key=lambda x: x[1])[-self.capacity :]:
            self._rows.pop(t, None)
            self._rows[t] = rows[i].clone()
        self._evict()

    def _evict(self) -> None:
        while len(self._rows) > self.capacity:
            self._rows.popitem(last=False)
