"""The weight matmul `y = x W^T + b`, dispatched by row count for CPU memory bandwidth.

Decode and verification are bandwidth-bound: every weight is read once per forward.
Measured on a 2-core AMX Xeon, bf16, cold weights [17920, 1536]: `F.linear` reads at
~18 GB/s for 1-16 rows; `torch.mv` at ~26 GB/s for one row and `W @ x^T` at ~25 GB/s for
2-16 rows. Past 16 rows (prefill) the work is compute-bound and `F.linear` (oneDNN/AMX)
wins. See docs/benchmarks-log.md.

fp32 goes to oneDNN's linear (the op torch.compile's CPU backend calls), not to MKL, which
`torch.mv`/`torch.mm`/`F.linear` use for fp32: on an AMD EPYC (Zen 4, 2 cores, AVX2 or
AVX512) MKL reads the 1.5B's [17920, 1536] fp32 matrix at 16 GB/s for one row and 6-11 GB/s
for 4-17 rows, oneDNN at 25 and 14-20 GB/s. Below `ONEDNN_MIN` weights its fixed cost per
call (~10 us) outweighs that.

Batch-invariant mode (decode and verification steps): a row's numbers never depend on
how many rows share the forward (decode of 1 vs verification of k+1 vs other sequences).
bf16/fp16 go through `W @ X^T` in tiles of exactly `INVARIANT_TILE` rows (zero-padded);
fp32 on a CPU through the native kernel (kernels/dense_linear.cpp: each row summed in one
order, no padding, where tiles would cost a decode step 16x its compute; at 2-16 rows it
also reads the weights faster than oneDNN). fp32 where the kernel does not run (a CPU
without AVX2; CUDA without specd.models.gpu's step) keeps the paths below, and its greedy
parity rests on rounding not flipping an argmax.

fp32 activations over a 16-bit checkpoint's matrices, kept 16-bit in memory (the loader,
where the kernel runs): decode and verification, and any call of up to 64 rows, in the
kernel, which widens each weight in a register (the bits of their fp32 copy from half the
bytes); prefill in slabs widened to fp32, within ~15% of fp32 weights' time on one AVX2
core (docs/benchmarks-log.md section 122).

Quantised weights (specd.models.qlinear) go to their own kernel, batch-invariant for any
row count; matrices that could not be fused (q/k/v of different bit widths) are a list.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specd.config import INVARIANT_TILE
from specd.models.native import kernel
from specd.models.qlinear import QWeight, qlinear, qlinear_parts

SMALL_M = 16
DENSE_KERNEL_WEIGHTS = (torch.float32, torch.bfloat16, torch.float16)
WIDEN_ROWS, SLAB = 64, 256  # fp32 x over a 16-bit w: see `_widened`
ONEDNN_MIN = 1 << 19  # weights
_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def linear(
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None = None,
    invariant: bool = False,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x [M, in] @ w [out, in]^T (+ b [out]) -> [M, out], cast to `out_dtype` if given."""
    m = x.shape[0]
    if isinstance(w, QWeight):
        return qlinear(x, w, b, out_dtype)
    if isinstance(w, list) and all(isinstance(part, QWeight) for part in w):
        y = qlinear_parts(x, w)
    elif isinstance(w, list):
        y = torch.cat([linear(x, part, invariant=invariant) for part in w], dim=-1)
    elif invariant and x.dtype != torch.float32:
        y = _tiled(x, w)
    elif invariant and _dense_kernel_fits(x, w):
        y = kernel().dense_linear(x.contiguous(), w)
    elif x.dtype == torch.float32 and w.dtype != x.dtype:
        y = _widened(x, w)
    elif _onednn_fits(x, w):
        y = _onednn(x, w)
    elif m == 1 and x.device.type == "cpu":
        y = torch.mv(w, x[0]).unsqueeze(0)
    elif m <= SMALL_M and x.device.type == "cpu":
        y = torch.mm(w, x.t())  # [out, M]: cast while contiguous, then transpose the view
        y = (y if out_dtype is None else y.to(out_dtype)).t()
    else:
        y = F.linear(x, w)
    if b is not None:
        y = y + b.to(y.dtype)
    return y if out_dtype is None else y.to(out_dtype)


def _onednn_fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """fp32 on the CPU, a matrix big enough to pay oneDNN's fixed cost (see above)."""
    fp32 = x.dtype == w.dtype == torch.float32
    return _ONEDNN and fp32 and x.device.type == "cpu" and w.numel() >= ONEDNN_MIN


def _dense_kernel_fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """fp32 activations on the CPU, where the native kernels run; weights fp32 or 16-bit."""
    fp32 = x.dtype == torch.float32 and w.dtype in DENSE_KERNEL_WEIGHTS and w.is_contiguous()
    return fp32 and x.device.type == "cpu" and kernel() is not None


def _widened(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """fp32 x over a 16-bit w: the native kernel up to `WIDEN_ROWS` rows (there it reads
    half the bytes of an fp32 w); past them, where the product is compute-bound and the
    kernel's register blocks reload x from cache, slabs of `SLAB` rows of w widened in
    turn into one fp32 buffer, each multiplied as an fp32 w would be."""
    if x.shape[0] <= WIDEN_ROWS and _dense_kernel_fits(x, w):
        return kernel().dense_linear(x.contiguous(), w)
    product = _onednn if _ONEDNN and x.device.type == "cpu" else F.linear
    out = x.new_empty(x.shape[0], w.shape[0])
    slab = x.new_empty(min(SLAB, w.shape[0]), w.shape[1])
    for n in range(0, w.shape[0], SLAB):
        part = slab[: min(SLAB, w.shape[0] - n)]
        part.copy_(w[n : n + SLAB])
        out[:, n : n + part.shape[0]] = product(x, part)
    return out


def _onednn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


def _tiled(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    m, tile = x.shape[0], INVARIANT_TILE
    pad = (-m) % tile
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    outs = [torch.mm(w, x[i : i + tile].t()).t() for i in range(0, x.shape[0], tile)]
    return torch.cat(outs)[:m]
