"""A decoder layer's element-wise work in Triton, one kernel each: the residual add with
RMSNorm, RoPE with the K/V write into the paged pools (and the QKV bias), SiLU(gate) * up.

Each program works on one row (or one row's slice), so a row's numbers never depend on
the other rows. They round where specd.models.layer_ops' torch code does: x + residual in
the activations' dtype, the norm in fp32 then to the dtype before the weight, SiLU then
the product, each rounded to the dtype. Rows at or past `rows` are left as they are (the
padding of a GEMM's fixed row count, specd.models.gpu.row_gemm)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specd.models.gpu import FP_FUSION


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, y_ptr, eps, H: tl.constexpr, BLOCK: tl.constexpr, ADD: tl.constexpr
):
    r = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    inside = i < H
    x = tl.load(x_ptr + r * H + i, mask=inside, other=0.0)
    if ADD:
        x = x.to(tl.float32) + tl.load(res_ptr + r * H + i, mask=inside, other=0.0).to(tl.float32)
        x = x.to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + r * H + i, x, mask=inside)
    xf = x.to(tl.float32)
    norm = xf * tl.rsqrt(tl.sum(xf * xf, 0) / H + eps)
    w = tl.load(w_ptr + i, mask=inside, other=0.0).to(tl.float32)
    y = norm.to(y_ptr.dtype.element_ty).to(tl.float32) * w
    tl.store(y_ptr + r * H + i, y.to(y_ptr.dtype.element_ty), mask=inside)


def add_rms_norm(x, residual, weight, eps: float, rows: int, out=None):
    """x [T, H] += residual (when given), in place; -> RMSNorm(x) * weight [T, H], for the
    first `rows` rows."""
    hidden = x.shape[1]
    y = torch.empty_like(x) if out is None else out
    if rows:
        _add_rms_norm_kernel[(rows,)](
            x, x if residual is None else residual, weight, y, eps,
            H=hidden, BLOCK=triton.next_power_of_2(hidden), ADD=residual is not None,
            **FP_FUSION,
        )  # fmt: skip
    return y


@triton.jit
def _rope_store_kernel(
    qkv_ptr, bias_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, q_ptr, k_ptr, v_ptr,
    HEADS: tl.constexpr, KV_HEADS: tl.constexpr, D: tl.constexpr, BIAS: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    h = tl.program_id(1)  # a query head, then a K/V head
    half = tl.arange(0, D // 2)
    width = (HEADS + 2 * KV_HEADS) * D
    pos = tl.load(pos_ptr + r)
    cos = tl.load(cos_ptr + pos * D + half).to(tl.float32)  # the table's halves are equal
    sin = tl.load(sin_ptr + pos * D + half).to(tl.float32)
    col = h * D + half  # the head's first half in the qkv row (a K head: after the queries)
    x1 = tl.load(qkv_ptr + r * width + col)
    x2 = tl.load(qkv_ptr + r * width + col + D // 2)
    if BIAS:
        x1 = (x1.to(tl.float32) + tl.load(bias_ptr + col).to(tl.float32)).to(x1.dtype)
        x2 = (x2.to(tl.float32) + tl.load(bias_ptr + col + D // 2).to(tl.float32)).to(x2.dtype)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    out1 = a * cos - b * sin  # x * cos + rotate_half(x) * sin, rotate_half = (-x2, x1)
    out2 = b * cos + a * sin
    if h < HEADS:
        at = (r * HEADS + h) * D + half
        tl.store(q_ptr + at, out1.to(q_ptr.dtype.element_ty))
        tl.store(q_ptr + at + D // 2, out2.to(q_ptr.dtype.element_ty))
    else:
        slot = tl.load(slot_ptr + r)
        if slot >= 0:  # a padding row writes nothing
            kvh = h - HEADS
            at = (slot * KV_HEADS + kvh) * D + half
            tl.store(k_ptr + at, out1.to(k_ptr.dtype.element_ty))
            tl.store(k_ptr + at + D // 2, out2.to(k_ptr.dtype.element_ty))
            vcol = (HEADS + KV_HEADS + kvh) * D + half
            v1 = tl.load(qkv_ptr + r * width + vcol)
            v2 = tl.load(qkv_ptr + r * width + vcol + D // 2)
            if BIAS:
                v1 = (v1.to(tl.float32) + tl.load(bias_ptr + vcol).to(tl.float32)).to(v1.dtype)
                v2b = tl.load(bias_ptr + vcol + D // 2).to(tl.float32)
                v2 = (v2.to(tl.float32) + v2b).to(v2.dtype)
            tl.store(v_ptr + at, v1.to(v_ptr.dtype.element_ty))
            tl.store(v_ptr + at + D // 2, v2.to(v_ptr.dtype.element_ty))


def rope_store(qkv, bias, cos, sin, positions, slots, k_pool, v_pool, heads, kv_heads, rows):
    """qkv [T, (heads + 2 kv_heads) * D] (+ bias), cos/sin tables [positions, D] ->
    q [T, heads, D] after RoPE; K after RoPE and V written to the pools at `slots` [T]
    (a slot < 0 writes nothing). The first `rows` rows."""
    dim = cos.shape[-1]
    q = torch.empty(qkv.shape[0], heads, dim, dtype=qkv.dtype, device=qkv.device)
    if rows:
        _rope_store_kernel[(rows, heads + kv_heads)](
            qkv, qkv if bias is None else bias, cos, sin, positions, slots, q, k_pool, v_pool,
            HEADS=heads, KV_HEADS=kv_heads, D=dim, BIAS=bias is not None, **FP_FUSION,
        )  # fmt: skip
    return q


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, I: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = i < I
    gate = tl.load(gu_ptr + r * 2 * I + i, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + r * 2 * I + I + i, mask=inside, other=0.0)
    dtype = out_ptr.dtype.element_ty
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + r * I + i, (act * up.to(tl.float32)).to(dtype), mask=inside)


def silu_mul(gate_up: torch.Tensor, rows: int) -> torch.Tensor:
    """[T, 2I] -> silu(gate) * up [T, I], the first `rows` rows."""
    inner = gate_up.shape[1] // 2
    out = gate_up.new_empty(gate_up.shape[0], inner)
    if rows:
        block = min(1024, triton.next_power_of_2(inner))
        grid = (rows, triton.cdiv(inner, block))
        _silu_mul_kernel[grid](gate_up, out, I=inner, BLOCK=block, **FP_FUSION)
    return out
