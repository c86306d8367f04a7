"""All the decoder layers of a step in one native call (`kernels/decoder.cpp`), where every
matrix is group-quantised and attention reads the paged pool in place: the same kernel
calls as `LlamaModel.hidden_states`'s loop, in the same order (the same bits), without
its per-layer Python. Built once per model from its layers; a model whose layers change
after the first step must drop `model._stack`."""

from __future__ import annotations

import math

import torch

from specd.models.native import kernel
from specd.models.qlinear import QWeight


def _parts(w) -> tuple[list[torch.Tensor], list[int]] | None:
    """A matrix as the kernel's (records, bits) parts; None unless all are quantised."""
    parts = w if isinstance(w, list) else [w]
    if not all(isinstance(p, QWeight) for p in parts):
        return None
    return [p.records for p in parts], [p.bits for p in parts]


def build(model):
    """The model's layers as one native stack, or None where the step must run in Python
    (no native ops, or a matrix that is not quantised)."""
    if not model._native_ops:  # (they need the kernels)
        return None
    a = model.args
    stack = kernel().DecoderStack(a.num_heads, a.num_kv_heads, a.head_dim, a.rms_norm_eps)
    for layer in model.layers:
        mats = [_parts(w) for w in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)]
        if any(m is None for m in mats):
            return None
        (qkv, qkv_bits), (o, o_bits), (gu, gu_bits), (down, down_bits) = mats
        stack.add_layer(
            layer.attn_norm, layer.mlp_norm, qkv, qkv_bits, layer.bqkv, o, o_bits, layer.bo,
            gu, gu_bits, down, down_bits, layer.q_norm, layer.k_norm,
        )  # fmt: skip
    return stack


def run(stack, x: torch.Tensor, kv, plan, cos, sin, head_dim: int) -> torch.Tensor:
    """x [T, H] -> the residual stream after the last layer (before the final norm)."""
    p = plan.paged
    return stack.forward(
        x, cos, sin, kv.k, kv.v, plan.write_slots, p.table, p.block_size, p.seq_rows,
        p.limit, p.tree, 1.0 / math.sqrt(head_dim),
    )  # fmt: skip
