"""Group-quantised weights (int4 / int8) and their linear, for the target and the drafter.

Format: unsigned codes q (4, 6 or 8 bits) in groups of 32 along the input dimension.
8 bits: one fp16 scale d and one fp16 min m per (output row, group): w = d * q - m.
4 bits: the same w = d * q - m with Q4_K's two-level scales: per super-block of 8 groups
(256 along K) an fp16 D and M per row, per group 6-bit integers s and t, d = D s and
m = M t (`TwoLevel`): 4.625 bits a weight where one fp16 pair per group took 5.
6 bits: symmetric, a scale per half-group of 16, w = d_h * (q - 32) (the general form
with m_h = 32 d_h implied, not stored), with Q6_K's two levels: d_h = D sc, an fp16 D per
row and super-block and an int8 sc per half-group: 6.625 bits a weight where an fp16
scale per 16 took 7.
GGUF blocks map onto it without requantising (a Q4_K super-block is 8 sub-blocks of 32
four-bit codes with 6-bit scales and mins under an fp16 d and dmin, a Q6_K super-block
16 sub-blocks of 16 six-bit codes with int8 scales under an fp16 d; see
`gguf_blocks.py`), dense weights are quantised by round-to-nearest (`quantize`).

The linear quantises activations to int8 per row and per block along K (32; for 4 and 6
bits on AVX2 256, a weight super-block, as llama.cpp's Q8_K, so that a super-block sums in
integers) and sums integer products exactly (`kernels/qlinear.cpp`), so a row's result
never depends on the other rows: greedy decoding with and without speculation round
identically. `reference` is the same maths in plain torch, for the tests. Where the
kernel cannot run (neither AVX512-VNNI nor AVX2, no compiler, CUDA),
specd.models.weights runs the model in bf16 instead.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from specd.models.native import kernel

log = logging.getLogger(__name__)

GROUP = 32
TILE = 16  # output columns per kernel tile
SIX_OFFSET = 32  # 6 bits: w = d * (q - 32), codes 0..63 for -32..31
SUPER = 8  # 4 and 6 bits: groups per super-block
# 4 and 6 bits: a super-block's header, 320 bytes: 16 fp16 D, 16 fp16 M (4 bits; zero for
# 6), then its integers: s and t as uint8 [8 groups, 16 rows] (4 bits), or the half-groups'
# int8 scales [16, 16] (6 bits)
HEADER = 64 + 2 * SUPER * TILE
# 6 bits: code vector j's top two bits sit at bits 2 (j % 4) of top-bit vector j // 4
_TOP_SHIFTS = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 1, 4, 1, 1)


@dataclass(frozen=True)
class TwoLevel:
    """A scale (or a min) as an fp16 value per row and super-block of 256 columns, `block`
    [N, ceil(K/256)], times an integer per row and unit, `group`: Q4_K's 6-bit integers per
    group of 32 (uint8 [N, K/32], `per_block` 8) or Q6_K's int8 per 16 ([N, K/16], 16)."""

    block: torch.Tensor  # fp32 holding fp16 values
    group: torch.Tensor  # uint8 0..63, or int8
    per_block: int = SUPER

    def expand(self) -> torch.Tensor:
        """Per unit, fp32: the products, exact (11 bits of mantissa times at most 8)."""
        per_unit = self.block.repeat_interleave(self.per_block, dim=1)[:, : self.group.shape[1]]
        return per_unit * self.group.float()

    def __getitem__(self, rows) -> TwoLevel:
        return TwoLevel(self.block[rows], self.group[rows], self.per_block)


def six_bit_mins(scales: TwoLevel) -> TwoLevel:
    """6 bits: the mins that w = d (q - 32) implies, 32 d (exact: a power of two)."""
    return TwoLevel(SIX_OFFSET * scales.block, scales.group, scales.per_block)


@functools.lru_cache(maxsize=8)
def _offsets4(kg: int) -> tuple[torch.Tensor, ...]:
    """4 bits: where each column c of a tile keeps its bytes in the tile's stream: codes
    [16, kg * 16] (per group 4 vectors x 4 bytes), D and M [16, nsb * 2] (fp16), s and t
    [16, kg]."""
    stride = HEADER + SUPER * 256  # a whole super-block
    g = torch.arange(kg)
    start = g // SUPER * stride  # of each group's super-block
    c = torch.arange(TILE).view(TILE, 1)
    vec = (torch.arange(4) * 64).view(4, 1) + torch.arange(4)  # [s, i]
    codes = (start + HEADER + g % SUPER * 256).view(1, kg, 1, 1) + 4 * c.view(TILE, 1, 1, 1) + vec
    blocks = (torch.arange(-(-kg // SUPER)) * stride).view(1, -1, 1) + torch.arange(2)
    d = blocks + 2 * c.view(TILE, 1, 1)
    s = start + 64 + g % SUPER * TILE + c
    return (codes.view(TILE, -1), d.view(TILE, -1), (d + 32).view(TILE, -1), s, s + SUPER * TILE)


def _rows4(tiles: torch.Tensor, col: torch.Tensor, kg: int) -> torch.Tensor:
    """4 bits: row `col[l]` of tile `tiles[l]` (uint8 [L, tile_bytes]) -> fp32 [L, K]."""
    codes, d, m, s, t = (tiles.gather(1, at[col]) for at in _offsets4(kg))
    nib = codes.view(-1, kg, 4, 1, 4)  # [l, g, s, half, i] -> k = 32 g + 8 s + 4 half + i
    q = torch.cat((nib & 0x0F, nib >> 4), dim=3).view(-1, kg, 32).float()

    def per_group(block, ints):  # fp16 bytes [L, nsb * 2], uint8 [L, kg] -> fp32 [L, kg]
        v = block.contiguous().view(torch.float16).float()
        return TwoLevel(v, ints).expand()

    y = q * per_group(d, s)[..., None] - per_group(m, t)[..., None]
    return y.view(len(col), -1)


def tile_bytes(kg: int, bits: int) -> int:
    """4 and 6 bits: one tile's stream for `kg` groups: per super-block its header and
    its groups' codes."""
    return -(-kg // SUPER) * HEADER + kg * GROUP * TILE * bits // 8


@dataclass
class QWeight:
    """A [N, K] weight in the kernel's layout, 16 rows (a tile) at a time. 8 bits: per
    (tile, 32-column group) one record of the codes (512 bytes), then 16 fp16 scales and 16
    fp16 mins. 4 and 6 bits: per (tile, super-block of 8 groups) a header (`HEADER`), then
    the codes of its groups, 256 or 384 bytes each; the last super-block of a row may have
    fewer groups."""

    records: torch.Tensor  # uint8 [N/16, K/32, code_bytes + 64]; 4, 6 bits [N/16, tile_bytes]
    bits: int
    shape: tuple[int, int]  # (N, K) of the dense weight

    @property
    def code_bytes(self) -> int:
        return GROUP * TILE * self.bits // 8

    def _super_blocks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """4 and 6 bits: (headers uint8 [t, nsb, HEADER], codes uint8 [t, kg, code_bytes])."""
        t, kg = self.shape[0] // TILE, self.shape[1] // GROUP
        nsb = -(-kg // SUPER)
        full = self.records
        if kg % SUPER:  # the last super-block, padded to a whole one
            full = torch.zeros(t, nsb * (HEADER + SUPER * self.code_bytes), dtype=torch.uint8)
            full[:, : self.records.shape[1]] = self.records
        full = full.view(t, nsb, -1)
        codes = full[..., HEADER:].reshape(t, nsb * SUPER, self.code_bytes)[:, :kg]
        return full[..., :HEADER], codes

    def codes(self) -> torch.Tensor:
        """The codes back as uint8 [N, K] (inverse of `pack`)."""
        n, k = self.shape
        t, kg = n // TILE, k // GROUP
        if self.bits == 8:
            b = self.records[..., : self.code_bytes]
            q = b.reshape(t, kg, 8, TILE, 4).permute(0, 3, 1, 2, 4)  # [t, c, g, j, i]
            return q.reshape(n, k)
        b = self._super_blocks()[1]
        nib = b[..., :256].reshape(t, kg, 4, TILE, 4)  # [t, g, s, c, i]
        both = torch.stack((nib & 0x0F, nib >> 4), dim=4)  # [t, g, s, c, half, i]
        q = both.permute(0, 3, 1, 2, 4, 5).reshape(n, k)  # [t, c, g, s, half, i]
        if self.bits == 6:
            q = q | (_top_bits(b[..., 256:], t, kg).reshape(n, k) << 4)
        return q

    def scales(self) -> tuple:
        """(d, m) as `pack` takes them: fp32 [N, K/32] (8 bits), or `TwoLevel` (4 bits;
        6 bits, where m = 32 d)."""
        if self.bits == 8:
            return self.group_params()
        n, k = self.shape
        head = self._super_blocks()[0]  # [t, nsb, HEADER]
        t, nsb, kg = n // TILE, head.shape[1], k // GROUP

        def block(at):  # fp16 [t, nsb, 16] -> [N, nsb]
            v = head[..., at : at + 32].contiguous().view(torch.float16).float()
            return v.permute(0, 2, 1).reshape(n, nsb)

        def ints(at, units):  # [t, nsb, units, 16] -> [N, nsb * units], to the last unit
            v = head[..., at : at + units * TILE].reshape(t, nsb, units, TILE)
            return v.permute(0, 3, 1, 2).reshape(n, nsb * units)[:, : kg * units // SUPER]

        if self.bits == 6:
            d = TwoLevel(block(0), ints(64, 2 * SUPER).view(torch.int8), 2 * SUPER)
            return d, six_bit_mins(d)
        return TwoLevel(block(0), ints(64, SUPER)), TwoLevel(block(32), ints(64 + 128, SUPER))

    def take_rows(self, rows: torch.Tensor) -> QWeight:
        """The weight of rows `rows` (a multiple of 16 of them), repacked: exact."""
        d, m = self.scales()
        return pack(self.codes()[rows], d[rows], m[rows], self.bits)

    def group_params(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(d, m) as fp32 [N, K/32], or [N, K/16] for 6 bits (where m = 32 d)."""
        if self.bits != 8:
            d, m = self.scales()
            return d.expand(), m.expand()
        n, k = self.shape
        tail = self.records[..., self.code_bytes :].contiguous().view(torch.float16)
        dm = tail.view(n // TILE, k // GROUP, 2, TILE).permute(0, 3, 1, 2)  # [t, c, g, 2]
        dm = dm.reshape(n, k // GROUP, 2).float()
        return dm[..., 0], dm[..., 1]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        d, m = self.group_params()
        n, k = self.shape
        q = self.codes().float().view(n, d.shape[1], -1)
        return (q * d[..., None] - m[..., None]).view(n, k).to(dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Dequantise only the rows `ids` [L] -> [L, K] (an embedding lookup from a tied
        head): the tiles holding them, then the rows."""
        tiles, col = ids // TILE, ids % TILE
        if self.bits == 4:
            return _rows4(self.records[tiles], col, self.shape[1] // GROUP).to(dtype)
        sub = QWeight(self.records[tiles], self.bits, (len(ids) * TILE, self.shape[1]))
        full = sub.dequantize(dtype).view(len(ids), TILE, -1)
        return full[torch.arange(len(ids)), col]


def _top_bits(b: torch.Tensor, t: int, kg: int) -> torch.Tensor:
    """The 6-bit layout's top-bit vectors uint8 [t, kg, 128] -> the top two bits of each
    code as [t, TILE, kg, 32] (inverse of `pack`'s)."""
    v = b.reshape(t, kg, 2, 1, TILE, 4)  # [t, g, h, 1, c, i]
    top = (v >> _TOP_SHIFTS) & 0x03  # [t, g, h, j, c, i]
    return top.permute(0, 4, 1, 2, 3, 5).reshape(t, TILE, kg, 32)


def fits(shape: tuple[int, int]) -> bool:
    """Can a [N, K] weight take this format (tiles of 16 rows, groups of 32 columns)?"""
    n, k = shape
    return n % TILE == 0 and k % GROUP == 0


def pack(q: torch.Tensor, d, m, bits: int) -> QWeight:
    """Codes [N, K] (0 .. 2**bits - 1), scales and mins -> the kernel's layout. 8 bits:
    fp32 [N, K/32] each. 4 bits: `TwoLevel` each. 6 bits: `TwoLevel` scales per 16 and
    mins 32 times them (the format keeps none)."""
    if bits in (4, 6):
        return _pack_super(q, d, m, bits)
    if bits != 8:
        raise ValueError(f"bits must be 4, 6 or 8, not {bits}")
    n, k = q.shape
    t, kg = n // TILE, k // GROUP
    codes = q.to(torch.uint8).view(t, TILE, kg, 8, 4).permute(0, 2, 3, 1, 4).reshape(t, kg, 512)

    def tiles(p):  # [N, kg] -> fp16 bytes [t, kg, 32]
        p = p.to(torch.float16).reshape(t, TILE, kg).permute(0, 2, 1).contiguous()
        return p.view(torch.uint8)

    records = torch.cat((codes, tiles(d), tiles(m)), dim=-1).contiguous()
    return QWeight(records, bits, (n, k))


def _nibbles(q: torch.Tensor, t: int, kg: int) -> torch.Tensor:
    """Codes' low nibbles uint8 [N, K] -> the 4-bit code vectors, bytes [t, kg, 256]."""
    # k = g*32 + s*8 + half*4 + i  ->  bytes [t, g, s, c, i] = lo | hi << 4
    v = (q & 0x0F).view(t, TILE, kg, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)  # [t,g,s,c,i,half]
    return (v[..., 0] | (v[..., 1] << 4)).reshape(t, kg, 256)


def _pack_super(q: torch.Tensor, d: TwoLevel, m: TwoLevel, bits: int) -> QWeight:
    n, k = q.shape
    t, kg = n // TILE, k // GROUP
    nsb = -(-kg // SUPER)
    q = q.to(torch.uint8)
    if bits == 4:
        for p in (d, m):
            if (
                p.block.shape != (n, nsb)
                or p.group.shape != (n, kg)
                or p.group.dtype != torch.uint8
                or int(p.group.max()) > 63
            ):
                raise ValueError("4 bits: an fp16 value per super-block, 6-bit integers per group")
        codes = _nibbles(q, t, kg)
    else:
        if (
            d.block.shape != (n, nsb)
            or d.group.shape != (n, 2 * kg)
            or d.group.dtype != torch.int8
            or not torch.equal(m.block, SIX_OFFSET * d.block)
            or not torch.equal(m.group, d.group)
        ):
            raise ValueError("6 bits: int8 scales per 16 columns, mins 32 times the scales")
        # the low nibbles as 4 bits', then the top two bits of code vector j (as 8-bit's:
        # k = 4j..4j+3 of 16 columns) at bits 2(j % 4) of vector j // 4
        top = (q >> 4).view(t, TILE, kg, 2, 4, 4).permute(0, 2, 3, 4, 1, 5)  # [t,g,h,j,c,i]
        packed = (top << _TOP_SHIFTS).sum(3, dtype=torch.uint8)  # bits never overlap
        codes = torch.cat((_nibbles(q, t, kg), packed.reshape(t, kg, 128)), dim=-1)

    def block(v):  # [N, nsb] -> fp16 bytes [t, nsb, 32]
        v = v.to(torch.float16).reshape(t, TILE, nsb).permute(0, 2, 1).contiguous()
        return v.view(torch.uint8)

    def ints(v, units):  # [N, <= nsb * units] -> bytes [t, nsb, units * 16], zero past the end
        full = torch.zeros(n, nsb * units, dtype=torch.uint8)
        full[:, : v.shape[1]] = v.view(torch.uint8)
        return full.view(t, TILE, nsb, units).permute(0, 2, 3, 1).reshape(t, nsb, -1)

    if bits == 4:
        heads = (block(d.block), block(m.block), ints(d.group, SUPER), ints(m.group, SUPER))
    else:
        heads = (
            block(d.block),
            torch.zeros(t, nsb, 32, dtype=torch.uint8),
            ints(d.group, 2 * SUPER),
        )
    full = torch.zeros(t, nsb * SUPER, codes.shape[-1], dtype=torch.uint8)
    full[:, :kg] = codes
    stream = torch.cat((*heads, full.view(t, nsb, -1)), dim=-1).view(t, -1)
    # the last super-block's missing groups are at the end of each tile's stream
    return QWeight(stream[:, : tile_bytes(kg, bits)].contiguous(), bits, (n, k))


def _two_level(per_unit: torch.Tensor, top: int, per_block: int, dtype) -> TwoLevel:
    """Non-negative fp32 [N, units] -> TwoLevel with integers up to `top` whose products
    are at least the values (rounded up, so a range never shrinks), bar the fp16 rounding
    of the block value."""
    n, units = per_unit.shape
    nsb = -(-units // per_block)
    padded = torch.zeros(n, nsb * per_block)
    padded[:, :units] = per_unit
    block = (padded.view(n, nsb, per_block).amax(-1) / top).half().float()
    per = block.repeat_interleave(per_block, dim=1)[:, :units]
    ints = torch.where(per > 0, torch.ceil(per_unit / per), torch.zeros_like(per))
    return TwoLevel(block, ints.clamp(0, top).to(dtype), per_block)


def quantize(w: torch.Tensor, bits: int) -> QWeight:
    """Round-to-nearest quantisation of a dense [N, K] weight: asymmetric in groups of 32
    (4 and 8 bits), symmetric in half-groups of 16 (6 bits)."""
    n, k = w.shape
    if bits == 6:  # Q6_K's form: int8 scales per 16 under an fp16 value per 256
        h = w.float().view(n, k // 16, 16)
        scales = _two_level(h.abs().amax(-1) / 31, 127, 2 * SUPER, torch.int8)
        d = scales.expand()
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        q = (h * inv[..., None]).round_().clamp_(-SIX_OFFSET, 31).add_(SIX_OFFSET)
        return pack(q.view(n, k), scales, six_bit_mins(scales), bits)
    levels = (1 << bits) - 1
    g = w.float().view(n, k // GROUP, GROUP)
    if bits == 4:  # Q4_K's form: the min first (a range that takes 0), then the scale
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        mins = _two_level(-lo, 63, SUPER, torch.uint8)
        m = mins.expand()
        scales = _two_level((hi + m) / levels, 63, SUPER, torch.uint8)
        d = scales.expand()
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        q = (g + m[..., None]).mul_(inv[..., None]).round_().clamp_(0, levels)
        return pack(q.view(n, k), scales, mins, bits)
    lo, hi = g.amin(-1), g.amax(-1)
    d = ((hi - lo) / levels).clamp(min=1e-12).half().float()  # the scale as stored
    m = (-lo).half().float()
    q = (g + m[..., None]).div_(d[..., None]).round_().clamp_(0, levels)
    return pack(q.view(n, k), d, m, bits)


def quantize_activations(x: torch.Tensor, block: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (codes int [M, K] in [-127, 127], scales fp32 [M, K/32]). One scale per
    row and `block` along K (32, or 256: a weight super-block, as llama.cpp's Q8_K; the
    last block of a row may be shorter), returned per group of 32, each its block's."""
    m, k = x.shape
    kg, per = k // GROUP, block // GROUP
    g = x.float().view(m, kg, GROUP)
    blocks = -(-kg // per)
    amax = g.abs().amax(-1)
    amax = torch.nn.functional.pad(amax, (0, blocks * per - kg)).view(m, blocks, per)
    amax = amax.amax(-1).repeat_interleave(per, dim=1)[:, :kg]
    # true division, as the kernel does (torch computes `127.0 / t` as `t.reciprocal() * 127`,
    # which can move a product onto a rounding tie)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(g * inv[..., None])
    return q.view(m, k), amax / 127.0


def reference(x, w: QWeight, bias=None, out_dtype=None) -> torch.Tensor:
    """The kernel's maths in plain torch (fp64 accumulation of the exact integer dots),
    per block of the weight's scales (32 columns, or 16 for 6 bits), with the activation
    block the kernel takes for this width."""
    xq, sx = quantize_activations(x, kernel().activation_block(w.bits))
    mrows, k = xq.shape
    d, mins = w.group_params()
    kg = d.shape[1]
    q = w.codes().double().view(-1, kg, k // kg)
    xg = xq.double().view(mrows, kg, k // kg)
    dots = torch.einsum("rgi,ngi->rng", xg, q)  # exact integers
    sums = xg.sum(-1)  # [M, kg]
    sxd = sx.double().repeat_interleave(kg // sx.shape[1], dim=1)
    y = (dots * (d.double()[None] * sxd[:, None])).sum(-1) - (
        mins.double()[None] * (sxd * sums)[:, None]
    ).sum(-1)
    if bias is not None:
        y = y + bias.double()
    return y.to(out_dtype or x.dtype)


# -- the kernel --------------------------------------------------------------------------
def qlinear(x: torch.Tensor, w: QWeight, bias: torch.Tensor | None = None, out_dtype=None):
    """x [M, K] @ dequant(w)^T (+ bias) -> [M, N] in `out_dtype` (default x's dtype)."""
    out = out_dtype or x.dtype
    b = _NO_BIAS if bias is None else bias.float()
    return kernel().qlinear(x.contiguous(), w.records, b, w.bits, out)


def qlinear_parts(x: torch.Tensor, ws: list[QWeight]) -> torch.Tensor:
    """Matrices side by side (a fused matrix whose parts have different widths): the
    separate calls' outputs concatenated, bit for bit, with x quantised once."""
    recs, bits = [w.records for w in ws], [w.bits for w in ws]
    return kernel().qlinear_parts(x.contiguous(), recs, bits, _NO_BIAS, x.dtype)


_NO_BIAS = torch.empty(0)
