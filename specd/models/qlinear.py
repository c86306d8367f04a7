"""Group-quantised weights (int4 / int8) and their linear, for the target and the drafter.

Format: unsigned codes q (4 or 8 bits), groups of 32 along the input dimension, one fp16
scale d and one fp16 min m per (output row, group):  w = d * q - m.  GGUF blocks map onto
it without requantising (a Q4_K sub-block is 32 four-bit codes with a scale and a min;
Q4_1, Q5_0 and Q8_0 likewise; see `gguf_blocks.py`), dense weights are quantised by
round-to-nearest between each group's min and max (`quantize`).

The linear quantises activations per row and per 32-block to int8 and sums integer
products exactly (`kernels/qlinear.cpp`), so a row's result never depends on the other
rows: greedy decoding with and without speculation round identically. `reference` is the
same maths in plain torch, for the tests. Where the kernel cannot run (no AVX512-VNNI, no
compiler, CUDA), specd.models.weights runs the model in bf16 instead.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

GROUP = 32
TILE = 16  # output columns per kernel tile
_KERNELS = Path(__file__).with_name("kernels")
_SOURCES = [_KERNELS / name for name in ("qlinear.cpp", "paged_attention.cpp", "bindings.cpp")]


@dataclass
class QWeight:
    """A [N, K] weight in the kernel's layout: per (16-row tile, 32-column group) one
    record of the codes (256 bytes for 4 bits, 512 for 8), 16 fp16 scales, 16 fp16 mins."""

    records: torch.Tensor  # uint8 [N/16, K/32, code_bytes + 64]
    bits: int
    shape: tuple[int, int]  # (N, K) of the dense weight

    @property
    def code_bytes(self) -> int:
        return GROUP * TILE * self.bits // 8

    def codes(self) -> torch.Tensor:
        """The codes back as uint8 [N, K] (inverse of `pack`)."""
        n, k = self.shape
        t, kg = n // TILE, k // GROUP
        b = self.records[..., : self.code_bytes]
        if self.bits == 4:
            b = b.reshape(t, kg, 4, TILE, 4)  # [t, g, s, c, i]
            both = torch.stack((b & 0x0F, b >> 4), dim=4)  # [t, g, s, c, half, i]
            q = both.permute(0, 3, 1, 2, 4, 5)  # [t, c, g, s, half, i]
        else:
            q = b.reshape(t, kg, 8, TILE, 4).permute(0, 3, 1, 2, 4)  # [t, c, g, j, i]
        return q.reshape(n, k)

    def group_params(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(d, m) as fp32 [N, K/32]."""
        n, k = self.shape
        tail = self.records[..., self.code_bytes :].contiguous().view(torch.float16)
        dm = tail.view(n // TILE, k // GROUP, 2, TILE).permute(2, 0, 3, 1)  # [2, t, c, g]
        d, m = dm.reshape(2, n, k // GROUP).float()
        return d, m

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        d, m = self.group_params()
        n, k = self.shape
        q = self.codes().float().view(n, k // GROUP, GROUP)
        return (q * d[..., None] - m[..., None]).view(n, k).to(dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Dequantise only the rows `ids` [L] -> [L, K] (an embedding lookup from a tied
        head): the tiles holding them, then the rows."""
        tiles, col = ids // TILE, ids % TILE
        sub = QWeight(self.records[tiles], self.bits, (len(ids) * TILE, self.shape[1]))
        full = sub.dequantize(dtype).view(len(ids), TILE, -1)
        return full[torch.arange(len(ids)), col]


def fits(shape: tuple[int, int]) -> bool:
    """Can a [N, K] weight take this format (tiles of 16 rows, groups of 32 columns)?"""
    n, k = shape
    return n % TILE == 0 and k % GROUP == 0


def pack(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bits: int) -> QWeight:
    """Codes [N, K] (0 .. 2**bits - 1), scales and mins [N, K/32] -> the kernel's layout."""
    n, k = q.shape
    t, kg = n // TILE, k // GROUP
    q = q.to(torch.uint8)
    if bits == 4:
        # k = g*32 + s*8 + half*4 + i  ->  bytes [t, g, s, c, i] = lo | hi << 4
        v = q.view(t, TILE, kg, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)  # [t, g, s, c, i, half]
        codes = (v[..., 0] | (v[..., 1] << 4)).reshape(t, kg, 256)
    elif bits == 8:
        codes = q.view(t, TILE, kg, 8, 4).permute(0, 2, 3, 1, 4).reshape(t, kg, 512)
    else:
        raise ValueError(f"bits must be 4 or 8, not {bits}")

    def tiles(p):  # [N, kg] -> fp16 bytes [t, kg, 32]
        p = p.to(torch.float16).reshape(t, TILE, kg).permute(0, 2, 1).contiguous()
        return p.view(torch.uint8)

    records = torch.cat((codes, tiles(d), tiles(m)), dim=-1).contiguous()
    return QWeight(records, bits, (n, k))


def quantize(w: torch.Tensor, bits: int) -> QWeight:
    """Round-to-nearest asymmetric quantisation of a dense [N, K] weight, groups of 32."""
    n, k = w.shape
    levels = (1 << bits) - 1
    g = w.float().view(n, k // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    d = ((hi - lo) / levels).clamp(min=1e-12).half().float()  # the scale as stored
    m = (-lo).half().float()
    q = torch.round((g + m[..., None]) / d[..., None]).clamp(0, levels)
    return pack(q.view(n, k), d, m, bits)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (codes int [M, K] in [-127, 127], scales fp32 [M, K/32])."""
    m, k = x.shape
    g = x.float().view(m, k // GROUP, GROUP)
    amax = g.abs().amax(-1)
    # true division, as the kernel does (torch computes `127.0 / t` as `t.reciprocal() * 127`,
    # which can move a product onto a rounding tie)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(g * inv[..., None])
    return q.view(m, k), amax / 127.0


def reference(x, w: QWeight, bias=None, out_dtype=None) -> torch.Tensor:
    """The kernel's maths in plain torch (fp64 accumulation of the exact integer dots)."""
    xq, sx = quantize_activations(x)
    mrows, k = xq.shape
    kg = k // GROUP
    d, mins = w.group_params()
    q = w.codes().double().view(-1, kg, GROUP)
    xg = xq.double().view(mrows, kg, GROUP)
    dots = torch.einsum("rgi,ngi->rng", xg, q)  # exact integers
    sums = xg.sum(-1)  # [M, kg]
    sxd = sx.double()
    y = (dots * (d.double()[None] * sxd[:, None])).sum(-1) - (
        mins.double()[None] * (sxd * sums)[:, None]
    ).sum(-1)
    if bias is not None:
        y = y + bias.double()
    return y.to(out_dtype or x.dtype)


# -- the kernel --------------------------------------------------------------------------
_kernel = None
_kernel_tried = False


def cpu_has_vnni() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return all(f in flags for f in ("avx512f", "avx512bw", "avx512_vnni", "f16c"))


_FLAGS = ["-O3", "-fopenmp", "-mf16c", "-mfma"]
_FLAGS += [f"-mavx512{x}" for x in ("f", "bw", "vl", "vnni")]


def kernel():
    """Build (once, cached under $SPECD_CACHE/kernels) and load the AVX512-VNNI kernels
    (this linear, and specd.models.attention's); None where this CPU or toolchain cannot
    run them."""
    global _kernel, _kernel_tried
    if _kernel_tried:
        return _kernel
    _kernel_tried = True
    # SPECD_BUILD_QKERNEL: build (and load, never run) where this CPU could not run it,
    # so an image build leaves the compiled kernel in the image's cache
    runnable = cpu_has_vnni() or os.environ.get("SPECD_BUILD_QKERNEL")
    if os.environ.get("SPECD_NO_QKERNEL") or not runnable:
        log.warning("no AVX512-VNNI on this CPU (or SPECD_NO_QKERNEL set): no int8/int4 kernel")
        return None
    try:
        _kernel = _build()
    except Exception as e:  # no compiler, no headers: the model runs bf16 (weights.choose)
        log.warning("could not build the int8/int4 kernel (%s)", e)
        _kernel = None
    return _kernel


def _build():
    from torch.utils.cpp_extension import load

    from specd.models.catalog import cache_root

    src = b"".join(path.read_bytes() for path in _SOURCES)
    tag = hashlib.sha256(src + torch.__version__.encode()).hexdigest()[:12]
    build = cache_root() / "kernels" / tag
    build.mkdir(parents=True, exist_ok=True)
    return load(
        name=f"specd_qlinear_{tag}",
        sources=[str(path) for path in _SOURCES],
        extra_cflags=_FLAGS,
        extra_ldflags=["-fopenmp"],
        build_directory=str(build),
        verbose=False,
    )


def qlinear(x: torch.Tensor, w: QWeight, bias: torch.Tensor | None = None, out_dtype=None):
    """x [M, K] @ dequant(w)^T (+ bias) -> [M, N] in `out_dtype` (default x's dtype)."""
    out = out_dtype or x.dtype
    b = _NO_BIAS if bias is None else bias.float()
    return kernel().qlinear(x.contiguous(), w.records, b, w.bits, out)


_NO_BIAS = torch.empty(0)
