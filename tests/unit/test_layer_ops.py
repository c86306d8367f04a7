"""The fused element-wise ops of a decoder layer (specd.models.layer_ops): the native
kernel against the torch maths it replaces, and a row's result alone or among others."""

import pytest
import torch

from specd.models import layer_ops

pytestmark = pytest.mark.usefixtures("cpu_kernels")  # fails, not skips, in CI

DTYPES = [torch.bfloat16, torch.float32]


def _rows(t: int, width: int, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, width, generator=g) * 3).to(dtype)


# (activations, K/V pools): the pools' own dtype, or a 16-bit cache under fp32 activations
ROPE_DTYPES = [(dt, dt) for dt in DTYPES] + [
    (torch.float32, torch.float16),
    (torch.float32, torch.bfloat16),
]


@pytest.mark.parametrize(("dtype", "pool_dtype"), ROPE_DTYPES)
def test_rope_and_the_kv_write_are_torchs_bit_for_bit(dtype, pool_dtype):
    t, heads, kv_heads, d = 11, 6, 2, 64
    qkv = _rows(t, (heads + 2 * kv_heads) * d, dtype, 0)
    angles = torch.rand(t, d // 2, generator=torch.Generator().manual_seed(1)) * 100
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    slots = torch.randperm(40, generator=torch.Generator().manual_seed(2))[:t]
    pools = {}
    for native in (False, True):
        k_pool, v_pool = (
            torch.zeros(40, kv_heads, d, dtype=pool_dtype),
            torch.zeros(40, kv_heads, d, dtype=pool_dtype),
        )
        q = layer_ops.rope_store(qkv, cos, sin, k_pool, v_pool, slots, heads, kv_heads, native)
        pools[native] = (q, k_pool, v_pool)
    for torch_t, native_t in zip(pools[False], pools[True], strict=True):
        assert torch.equal(torch_t, native_t)
    assert pools[True][1][slots].abs().sum() > 0  # the keys really landed in their slots
    assert pools[True][0].dtype == dtype and pools[True][2].dtype == pool_dtype


@pytest.mark.parametrize("dtype", DTYPES)
def test_residual_add_and_rms_norm_match_torch_and_ignore_the_other_rows(dtype):
    t, h, eps = 37, 1536, 1e-6
    x, res = _rows(t, h, dtype, 3), _rows(t, h, dtype, 4)
    w = (1 + 0.1 * _rows(1, h, dtype, 5))[0]
    x_torch, y_torch = layer_ops.add_rms_norm(x.clone(), res, w, eps, native=False)
    x_native = x.clone()
    x_out, y_native = layer_ops.add_rms_norm(x_native, res, w, eps, native=True)
    assert x_out.data_ptr() == x_native.data_ptr()  # in place
    assert torch.equal(x_native, x_torch)  # the add rounds as torch's
    # the norm's sum of squares is summed in another order: within one rounding step
    tol = 2**-7 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(y_native.float(), y_torch.float(), rtol=tol, atol=tol)
    for r in (0, 17, t - 1):  # alone: bit for bit what it was among 37 rows (threads split rows)
        alone = x[r : r + 1].clone()
        _, y_alone = layer_ops.add_rms_norm(alone, res[r : r + 1], w, eps, native=True)
        assert torch.equal(y_alone, y_native[r : r + 1])
    _, y_plain = layer_ops.add_rms_norm(x.clone(), None, w, eps, native=True)
    _, y_plain_torch = layer_ops.add_rms_norm(x.clone(), None, w, eps, native=False)
    torch.testing.assert_close(y_plain.float(), y_plain_torch.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_tracks_torchs_and_a_row_is_the_same_alone(dtype):
    """Its own exp (a polynomial, not torch's Sleef): fp32 within a few units in the last
    place of torch's, bf16 within one unit (rounded twice where torch rounds). A row
    alone gives the bits it gave among 37 (threads split rows only)."""
    gate_up = _rows(37, 2 * 96, dtype, 6)
    gate_up[0, :8] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 60.0, -60.0, 100.0, -100.0])
    native = layer_ops.silu_mul(gate_up, native=True)
    want = layer_ops.silu_mul(gate_up, native=False)
    assert native.dtype == dtype and native.shape == want.shape
    if dtype == torch.float32:
        torch.testing.assert_close(native, want, rtol=1e-6, atol=1e-30)
    else:  # one bf16 unit: 2^-7 relative
        torch.testing.assert_close(native.float(), want.float(), rtol=2**-7, atol=1e-30)
        assert (native != want).float().mean() < 0.01
    for r in (0, 17, 36):
        alone = layer_ops.silu_mul(gate_up[r : r + 1].clone(), native=True)
        assert torch.equal(alone, native[r : r + 1])


def test_bad_shapes_and_slots_are_errors_not_crashes():
    d, qkv = 64, _rows(2, (4 + 2 * 2) * 64, torch.bfloat16, 7)
    cos = sin = torch.ones(2, d, dtype=torch.bfloat16)
    pool = torch.zeros(8, 2, d, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="slot out of the pool"):
        layer_ops.rope_store(qkv, cos, sin, pool, pool.clone(), torch.tensor([0, 8]), 4, 2, True)
    with pytest.raises(RuntimeError, match="qkv must be"):
        layer_ops.rope_store(qkv, cos, sin, pool, pool.clone(), torch.tensor([0, 1]), 5, 2, True)
    with pytest.raises(RuntimeError, match="share a dtype"):
        x = _rows(2, 64, torch.float32, 8)
        layer_ops.add_rms_norm(x, None, torch.ones(64, dtype=torch.bfloat16), 1e-6, True)
