"""The element-wise parts of a decoder layer: the residual add with RMSNorm, RoPE with the
K/V write into the paged pools, and SiLU(gate) * up.

On a CPU that runs specd's kernels each is one native call (`kernels/layer_ops.cpp`):
at one row a decode step spent 12 ms of 68 (the 1.5B target) and 11 of 30 (the 0.5B
drafter) in the ~20 small torch ops per layer these replace, and their Python. Elsewhere
(CUDA, or no kernel) the same maths runs in torch. Both round where the other does,
except the RMSNorm's sum of squares (its own fixed order natively) and SiLU's exp (a
polynomial natively, within one bf16 unit of torch's); either way every row is computed
on its own, so a row's result never depends on the other rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specd.models.native import kernel


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Can this model's layers take the native ops?"""
    ok = device.type == "cpu" and dtype in (torch.bfloat16, torch.float32)
    return ok and kernel() is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight, computed in fp32 as transformers does."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, native: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, its RMSNorm); natively x itself is updated in place."""
    if native:
        empty = residual if residual is not None else _EMPTY
        y = kernel().add_rms_norm(x, empty.contiguous(), weight, eps)
        return x, y
    if residual is not None:
        x = x + residual
    return x, rms_norm(x, weight, eps)


def rope_store(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    heads: int,
    kv_heads: int,
    native: bool,
) -> torch.Tensor:
    """qkv [T, (heads + 2 kv_heads) * D], cos/sin [T, D] -> q [T, heads, D] after RoPE;
    k after RoPE and v are written to the pools at `slots` [T], rounded to the pools'
    dtype (specd.models.paged_kv.kv_dtype)."""
    d = cos.shape[-1]
    if native:
        return kernel().rope_store(
            qkv.contiguous(), cos, sin, k_pool, v_pool, slots, heads, kv_heads
        )
    n_q, n_kv = heads * d, kv_heads * d
    c, s = cos[:, None, :], sin[:, None, :]
    q = qkv[:, :n_q].view(-1, heads, d)
    k = qkv[:, n_q : n_q + n_kv].view(-1, kv_heads, d)
    v = qkv[:, n_q + n_kv :].view(-1, kv_heads, d)
    k_pool.index_copy_(0, slots, (k * c + _rotate_half(k) * s).to(k_pool.dtype))
    v_pool.index_copy_(0, slots, v.to(v_pool.dtype))
    return q * c + _rotate_half(q) * s


def qk_norm(
    qkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    heads: int,
    kv_heads: int,
    eps: float,
    native: bool = False,
) -> torch.Tensor:
    """Qwen3's per-head RMSNorm of the queries and keys in qkv [T, (heads + 2 kv_heads) * D]
    (after any bias, before RoPE) -> a new qkv, the values as they were."""
    if native:
        return kernel().qk_norm(qkv.contiguous(), q_weight, k_weight, heads, kv_heads, eps)
    d = q_weight.shape[0]
    n_q, n_k = heads * d, kv_heads * d
    q = rms_norm(qkv[:, :n_q].reshape(-1, heads, d), q_weight, eps)
    k = rms_norm(qkv[:, n_q : n_q + n_k].reshape(-1, kv_heads, d), k_weight, eps)
    return torch.cat((q.flatten(1), k.flatten(1), qkv[:, n_q + n_k :]), dim=1)


def silu_mul(gate_up: torch.Tensor, native: bool) -> torch.Tensor:
    """[T, 2I] -> silu(gate) * up [T, I]."""
    if native:
        return kernel().silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


_EMPTY = torch.empty(0)
