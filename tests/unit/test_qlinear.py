"""The group-quantised format and its kernel: layout round trips, the kernel against a
slow reference of the same maths, and batch invariance (a row's bits never depend on the
other rows: what makes greedy decoding identical with and without speculation)."""

import os
import subprocess
import sys

import pytest
import torch

from specd.models import native
from specd.models import qlinear as ql


@pytest.fixture
def kernel(cpu_kernels):
    return cpu_kernels


def two_level(g, n, k, bits=4):
    """Random scales of the 4- or 6-bit format: an fp16 value per row and super-block,
    6-bit integers per group (4 bits) or int8 per 16 columns (6 bits)."""
    block = torch.randn(n, -(-k // 256), generator=g).half().float()
    if bits == 6:
        ints = torch.randint(-128, 128, (n, k // 16), generator=g).to(torch.int8)
        return ql.TwoLevel(block, ints, 16)
    return ql.TwoLevel(block, torch.randint(0, 64, (n, k // 32), generator=g, dtype=torch.uint8))


@pytest.mark.parametrize("bits, k", [(4, 96), (4, 608), (6, 96), (6, 608), (8, 96)])
def test_pack_round_trips_codes_and_group_params(bits, k):
    g = torch.Generator().manual_seed(0)
    n = 48
    block = 16 if bits == 6 else 32  # 6 bits: a scale per half-group, the min 32 times it
    q = torch.randint(0, 1 << bits, (n, k), generator=g, dtype=torch.uint8)
    if bits in (4, 6):  # k = 608: two super-blocks and a third of three groups
        d = two_level(g, n, k, bits)
        m = ql.six_bit_mins(d) if bits == 6 else two_level(g, n, k)
        assert ql.pack(q, d, m, bits).records.shape == (n // 16, ql.tile_bytes(k // 32, bits))
    else:
        d = torch.randn(n, k // block, generator=g).half().float()
        m = torch.randn(n, k // block, generator=g).half().float()
    w = ql.pack(q, d, m, bits)
    assert torch.equal(w.codes(), q)
    d2, m2 = w.scales()
    if bits in (4, 6):
        assert all(
            torch.equal(a.block, b.block) and torch.equal(a.group, b.group)
            for a, b in ((d, d2), (m, m2))
        )
        d, m = d.expand(), m.expand()  # the products, exact in fp32
        per = 256 // block
        exact = d2.block.double().repeat_interleave(per, 1)[:, : k // block] * d2.group.double()
        assert torch.equal(d, exact.float())
    assert all(torch.equal(a, b) for a, b in zip(w.group_params(), (d, m), strict=True))
    dense = (q.float().view(n, -1, block) * d[..., None] - m[..., None]).view(n, k)
    assert torch.equal(w.dequantize(), dense)
    ids = torch.tensor([0, 17, 47, 17])
    assert torch.equal(w.rows(ids, torch.float32), dense[ids])
    order = torch.randperm(n, generator=g)  # rows taken and repacked: exact
    assert torch.equal(w.take_rows(order).dequantize(), dense[order])


def test_scales_must_be_two_level():
    g = torch.Generator().manual_seed(4)
    q = torch.zeros(16, 64, dtype=torch.uint8)
    good = two_level(g, 16, 64)
    with pytest.raises(ValueError, match="4 bits"):
        ql.pack(q, ql.TwoLevel(good.block, good.group + 64), good, 4)  # not 6 bits
    with pytest.raises(ValueError, match="4 bits"):
        ql.pack(q, ql.TwoLevel(good.block, good.group[:, :1]), good, 4)
    six = two_level(g, 16, 64, 6)
    with pytest.raises(ValueError, match="6 bits"):  # the mins must be 32 times the scales
        ql.pack(q, six, ql.TwoLevel(six.block, six.group, 16), 6)
    with pytest.raises(ValueError, match="6 bits"):  # int8 per 16 columns
        ql.pack(q, ql.TwoLevel(six.block, six.group[:, :2], 16), ql.six_bit_mins(six), 6)


@pytest.mark.parametrize("bits", [4, 6, 8])
def test_quantize_error_is_half_a_step_per_group(bits):
    w = torch.randn(32, 512) * torch.linspace(0.01, 2.0, 32)[:, None]
    q = ql.quantize(w, bits)
    d, _ = q.group_params()  # per 32 columns, or per 16 for 6 bits
    err = (q.dequantize() - w).abs().view(32, d.shape[1], -1)
    # half a step, plus the fp16 rounding of the stored min (or scale)
    assert (err <= d.abs()[..., None] / 2 + 2e-3 * w.abs().max()).all()
    if bits == 4:  # the 6-bit integers round up: a group's step is the one it needs
        # plus at most 1/63 of its super-block's largest, twice (its min's and its scale's)
        lo, hi = w.view(32, -1, 32).amin(-1).clamp(max=0), w.view(32, -1, 32).amax(-1)
        need = ((hi - lo) / 15).view(32, -1, 8)
        largest = need.amax(-1, keepdim=True)
        assert (d.view(32, -1, 8) <= need + 2.1 * largest / 63).all()


@pytest.mark.parametrize("bits", [4, 6, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [320, 608])  # short last super-blocks of 2 and 3 groups
def test_kernel_matches_the_reference(kernel, bits, dtype, k):
    torch.manual_seed(1)
    w = ql.quantize(torch.randn(96, k) * 0.05, bits)
    bias = torch.randn(96)
    # 5 and 7 are one rolled block on AVX2, 13 and 15 a block of 8 and one of 5 or 7; 13
    # and 15 take AMX where it is granted
    for rows in (1, 5, 7, 8, 13, 15):
        x = (torch.randn(rows, k) * torch.linspace(0.1, 8, k)).to(dtype)
        got = ql.qlinear(x, w, bias, out_dtype=torch.float32).double()
        ref = ql.reference(x, w, bias, out_dtype=torch.float64)
        assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()
    # bf16 output is the fp32 result rounded to nearest even
    y32 = ql.qlinear(x, w, out_dtype=torch.float32)
    assert torch.equal(ql.qlinear(x, w, out_dtype=torch.bfloat16), y32.to(torch.bfloat16))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_codes_and_scales_are_the_references_bit_for_bit(kernel, bits, dtype):
    """An identity (d = 1, m = 0) reads each activation back as its code times its block's
    scale, one rounding: the kernel's quantisation of the activations (vectorised) must
    give quantize_activations' codes and scales exactly, rounding ties to even, per block of
    the width's size (4 bits on AVX2: 256 along K, here with a shorter last block of 64)."""
    k = 320
    block = kernel.activation_block(bits)
    assert block in (32, 256) and kernel.activation_block(8) == 32
    eye = torch.eye(k, dtype=torch.uint8)
    if bits == 4:
        ones = ql.TwoLevel(torch.ones(k, 2), torch.ones(k, k // 32, dtype=torch.uint8))
        w = ql.pack(eye, ones, ql.TwoLevel(ones.block, ones.group * 0), 4)
    else:
        ones = torch.ones(k, k // 32)
        w = ql.pack(eye, ones, ones * 0, 8)
    torch.manual_seed(6)
    x = torch.randn(5, k) * torch.logspace(-4, 3, k)
    x[1, :block] = 0  # a block of zeros
    x[2, :block] = torch.tensor([127.0, 2.5, 3.5, -0.5, -1.5, 0.5, 126.5, -126.5] * (block // 8))
    x[3, 256:] = torch.linspace(-1, 1, 64)  # the short block has its own scale
    x = x.to(dtype)
    codes, scales = ql.quantize_activations(x, block)
    assert torch.equal(codes[2, :8], torch.tensor([127.0, 2, 4, -0, -2, 0, 126, -126]))  # ties
    assert scales[3, 8] == 1 / 127
    per = block // 32
    assert torch.equal(scales[:, :per], scales[:, :1].expand(-1, per))
    want = (codes * scales.repeat_interleave(32, dim=1)).float()
    for rows in (1, 5):  # one row alone (the model thread's path) and a batch
        assert torch.equal(ql.qlinear(x[:rows], w, out_dtype=torch.float32), want[:rows])


def test_reference_catches_a_wrong_kernel(kernel):
    """The reference is sharp enough to see one code off by one."""
    torch.manual_seed(2)
    w = ql.quantize(torch.randn(32, 64), 4)
    q = w.codes()
    q[3, 7] = (q[3, 7] + 1) % 16
    wrong = ql.pack(q, *w.scales(), 4)
    x = torch.randn(2, 64)
    ref = ql.reference(x, w, out_dtype=torch.float64)
    assert (ql.qlinear(x, wrong, out_dtype=torch.float32).double() - ref).abs().max() > 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [4, 6, 8])
def test_rows_do_not_depend_on_the_other_rows(kernel, bits, dtype):
    torch.manual_seed(3)
    w = ql.quantize(torch.randn(1024, 512) * 0.05, bits)
    x = torch.randn(21, 512).to(dtype) * 3
    batched = ql.qlinear(x, w)
    for i in range(len(x)):  # alone, as a decode step
        assert torch.equal(ql.qlinear(x[i : i + 1], w), batched[i : i + 1])
    for lo, hi in ((0, 7), (5, 17), (3, 4), (2, 17)):  # inside other batch shapes
        assert torch.equal(ql.qlinear(x[lo:hi], w), batched[lo:hi])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_parts_side_by_side_are_the_separate_calls(kernel, dtype):
    """A fused matrix whose parts have different widths (q, k at 4 bits, v at 6 or 8):
    one call, x quantised once, gives the separate calls' outputs concatenated, bit for
    bit, at every row count, with and without a bias."""
    torch.manual_seed(5)
    parts = [ql.quantize(torch.randn(n, 512) * 0.05, b) for n, b in ((96, 4), (32, 6), (48, 8))]
    bias = torch.randn(176)
    for rows in (1, 4, 7, 9, 17):
        x = (torch.randn(rows, 512) * 3).to(dtype)
        want = torch.cat([ql.qlinear(x, p) for p in parts], dim=-1)
        assert torch.equal(ql.qlinear_parts(x, parts), want), rows
        recs, bits = [p.records for p in parts], [p.bits for p in parts]
        with_bias = kernel.qlinear_parts(x, recs, bits, bias, torch.float32)
        split = bias.split([96, 32, 48])
        alone = [ql.qlinear(x, p, b, torch.float32) for p, b in zip(parts, split, strict=True)]
        assert torch.equal(with_bias, torch.cat(alone, dim=-1)), rows
    with pytest.raises(RuntimeError, match="layout"):
        ql.qlinear_parts(torch.randn(2, 512), [parts[0], ql.quantize(torch.randn(16, 256), 4)])
    assert ql.qlinear_parts(torch.randn(0, 512), parts).shape == (0, 176)


@pytest.fixture
def amx(kernel):
    """The AMX path for every call of at least 1 row while the test runs."""
    if native.cpu_isa() != "avx512":
        pytest.skip(f"the {native.cpu_isa()} build has no AMX path (only the AVX512 build has)")
    if not kernel.amx_available():
        pytest.skip("this CPU (or its OS) grants no AMX: the AMX path cannot run here")
    old = kernel.set_amx_min_rows(1)
    yield kernel
    kernel.set_amx_min_rows(old)


@pytest.mark.parametrize("bits", [4, 6, 8])
def test_amx_path_gives_the_same_bits_as_the_vector_path(amx, bits):
    """AMX takes the integer dots of calls with many rows; the float terms after them are
    the same instructions, so every row must come out bit for bit as on the vector path
    (which decodes one row at a time): what keeps speculation exact at any batch size."""
    torch.manual_seed(5)
    # 608: a partial last super-block; 96: fewer groups than the AMX pipeline is deep
    for k in (608, 96):
        w = ql.quantize(torch.randn(64, k) * 0.05, bits)
        bias = torch.randn(64)
        x = torch.randn(37, k, dtype=torch.bfloat16) * 3
        for rows in (1, 2, 7, 9, 16, 17, 37):  # 17 and 37 run as blocks of 9 and 13 rows
            for out in (torch.float32, torch.bfloat16):
                on = ql.qlinear(x[:rows], w, bias, out_dtype=out)
                amx.set_amx_min_rows(0)
                off = ql.qlinear(x[:rows], w, bias, out_dtype=out)
                amx.set_amx_min_rows(1)
                assert torch.equal(on, off), (k, rows, out)


_FAULTING_TILE_UNIT = """
import torch
from specd.models import qlinear as ql
from specd.models.native import kernel
k = kernel()
assert not k.amx_available()
torch.manual_seed(7)
w = ql.quantize(torch.randn(64, 256) * 0.05, 4)
x = torch.randn(16, 256)  # past the AMX threshold
got = ql.qlinear(x, w, out_dtype=torch.float32).double()
ref = ql.reference(x, w, out_dtype=torch.float64)
assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()
print("vector path")
"""


def test_a_tile_unit_that_faults_leaves_the_vector_path(amx):
    """Some hypervisors grant AMX and still fault (SIGILL) at the first tile instruction:
    the kernel tries one tile operation under a SIGILL handler when it loads, and where
    it faults (here made to, on purpose) the process lives on with the vector path, with
    Python's faulthandler installed as under pytest."""
    env = {**os.environ, "SPECD_AMX_PROBE_FAULT": "1"}
    run = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", _FAULTING_TILE_UNIT],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert "vector path" in run.stdout


@pytest.mark.parametrize("bits", [4, 6, 8])
def test_largest_codes_and_activations_sum_exactly(kernel, bits):
    """Every code at its largest against activations at +-127 after quantisation, under
    the largest integer scales (4 bits s = t = 63, 6 bits sc = 127), over two super-blocks:
    the integer dots must not saturate (AVX2 sums u8 x s8 pairs in int16, and a
    super-block's scaled sums in int32)."""
    n, k = 32, 512
    top = (1 << bits) - 1
    q = torch.full((n, k), top, dtype=torch.uint8)
    q[1::2, ::3] = 0  # other columns mix the extremes
    if bits == 4:  # w = 63/64 q - 63/64
        d = ql.TwoLevel(torch.full((n, 2), 1 / 64), torch.full((n, k // 32), 63, dtype=torch.uint8))
        w = ql.pack(q, d, d, bits)
        offset, scale = 1, 63
    elif bits == 6:  # w = 127/64 (q - 32)
        d = ql.TwoLevel(
            torch.full((n, 2), 1 / 64), torch.full((n, k // 16), 127, dtype=torch.int8), 16
        )
        w = ql.pack(q, d, ql.six_bit_mins(d), bits)
        offset, scale = 32, 127
    else:  # w = q / 64
        d = torch.full((n, k // 32), 1 / 64)  # exact in fp16
        w = ql.pack(q, d, d * 0, bits)
        offset, scale = 0, 1
    x = torch.ones(3, k)
    x[1] = -1.0
    x[2, ::2] = -1.0
    got = ql.qlinear(x, w, out_dtype=torch.float32).double()
    ref = ql.reference(x, w, out_dtype=torch.float64)
    assert (got - ref).abs().max() <= 1e-6 * ref.abs().max()
    assert got[0, 0] == (top - offset) * scale * k / 64  # exact: no clipped partial sums
    if kernel.amx_available():  # and the AMX path's
        old = kernel.set_amx_min_rows(1)
        try:
            assert torch.equal(ql.qlinear(x, w, out_dtype=torch.float32).double(), got)
        finally:
            kernel.set_amx_min_rows(old)


def test_zero_rows_and_bad_layout(kernel):
    w = ql.quantize(torch.randn(32, 64), 4)
    assert ql.qlinear(torch.randn(0, 64), w).shape == (0, 32)
    with pytest.raises(RuntimeError, match="layout"):
        ql.qlinear(torch.randn(2, 96), w)
