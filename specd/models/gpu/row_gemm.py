"""The weight matmul on a GPU, at one fixed row count.

cuBLAS picks its kernel (tile shape, split-K) by the problem's shape, and two kernels
round a row's dot products differently: a 1-row decode and a (k+1)-row verification of
the same token could disagree on a near-tie. So every activation matrix is laid out with
a row count that is a multiple of `tile` (the padding rows are never read back), and the
GEMM runs `tile` rows at a time: one shape, one kernel, the same bits for a row alone, in
a batch, in a graph or eagerly. Decode is bound by reading the weights, and up to `tile`
rows read them once; past it each further tile reads them again (a prefill of 2048
tokens at tile 64: 32 passes).
"""

from __future__ import annotations

import torch

TILE = 64


def padded(rows: int, tile: int) -> int:
    """The row count a step's activations are laid out with."""
    return max(tile, -(-rows // tile) * tile)


def row_linear(x: torch.Tensor, w: torch.Tensor, tile: int, out=None) -> torch.Tensor:
    """x [M, in] (M a multiple of `tile`) @ w [out, in]^T -> [M, out] (into `out` where
    given), `tile` rows a GEMM."""
    m = x.shape[0]
    if m % tile:
        raise ValueError(f"{m} rows is not a multiple of the GEMM tile {tile}")
    if out is None:
        if m == tile:
            return torch.mm(x, w.t())
        out = x.new_empty(m, w.shape[0])
    for i in range(0, m, tile):
        torch.mm(x[i : i + tile], w.t(), out=out[i : i + tile])
    return out
