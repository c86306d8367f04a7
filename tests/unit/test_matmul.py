"""The dense weight matmul (specd.models.matmul.linear): every path it dispatches to, by
dtype, weight size and row count, computes x W^T + b."""

import pytest
import torch

from specd.models import matmul


@pytest.mark.parametrize("out_features", [64, matmul.ONEDNN_MIN // 128 + 8])  # below, above
@pytest.mark.parametrize("rows", [1, 4, matmul.SMALL_M + 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_is_x_times_w_transposed_plus_b(dtype, rows, out_features):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 128, generator=g).to(dtype)
    w = torch.randn(out_features, 128, generator=g).to(dtype)
    b = torch.randn(out_features, generator=g).to(dtype)
    want = x.double() @ w.double().T + b.double()
    for invariant in (False, True):
        got = matmul.linear(x, w, b, invariant=invariant, out_dtype=torch.float32)
        assert got.dtype == torch.float32 and got.shape == (rows, out_features)
        # a bf16 result is rounded to bf16's 8 bits; fp32 sums 128 products to within 1e-4
        tol = 0.1 if dtype == torch.bfloat16 else 1e-4
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=0.02)


@pytest.mark.parametrize(("inputs", "outputs"), [(1536, 64), (1541, 7), (8, 1)])  # K % 8, N % 3
def test_fp32_rows_round_the_same_whatever_rows_share_the_call(cpu_kernels, inputs, outputs):
    """Batch-invariant fp32 on a CPU (the native kernel): each row's bits are those it has
    alone, at every row count and place in the register blocks, and x W^T to fp32's
    precision."""
    g = torch.Generator().manual_seed(inputs)
    x = torch.randn(21, inputs, generator=g)
    w = torch.randn(outputs, inputs, generator=g)
    alone = torch.cat([matmul.linear(x[r : r + 1], w, invariant=True) for r in range(len(x))])
    torch.testing.assert_close(alone.double(), x.double() @ w.double().T, atol=1e-3, rtol=1e-5)
    for rows in (2, 3, 4, 5, 8, 17, 21):
        assert torch.equal(matmul.linear(x[:rows], w, invariant=True), alone[:rows]), rows
    order = torch.randperm(len(x), generator=g)
    assert torch.equal(matmul.linear(x[order], w, invariant=True), alone[order])


@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float16])
def test_fp32_rows_over_16bit_weights_have_the_bits_of_their_fp32_copy(cpu_kernels, wdtype):
    """fp32 activations over a 16-bit matrix (a 16-bit checkpoint read under fp32): the
    kernel widens each weight in a register, so every row count up to `WIDEN_ROWS`, and
    every invariant call, gives exactly what the fp32 copy of the matrix gives; past
    `WIDEN_ROWS` (prefill) the matrix is widened a slab at a time, across a partial last
    slab, to fp32's precision."""
    g = torch.Generator().manual_seed(7)
    inputs, outputs = 1541, matmul.SLAB + 5  # K % 8 and a partial slab
    w16 = torch.randn(outputs, inputs, generator=g).to(wdtype)
    w32 = w16.float()
    b = torch.randn(outputs, generator=g)
    x = torch.randn(matmul.WIDEN_ROWS + 3, inputs, generator=g)
    for rows in (1, 4, 17, matmul.WIDEN_ROWS, len(x)):
        want = matmul.linear(x[:rows], w32, b, invariant=True)
        assert torch.equal(matmul.linear(x[:rows], w16, b, invariant=True), want), rows
        if rows <= matmul.WIDEN_ROWS:
            assert torch.equal(matmul.linear(x[:rows], w16, b), want), rows
    prefill = matmul.linear(x, w16, b)
    assert prefill.dtype == torch.float32 and prefill.shape == (len(x), outputs)
    want = x.double() @ w32.double().T + b.double()
    torch.testing.assert_close(prefill.double(), want, atol=1e-3, rtol=1e-5)
