"""Weight-only int8 for the drafter: per-output-channel symmetric scales.

The target never uses this: its distribution is the contract. The drafter's is free —
rejection sampling is exact for whatever q the drafter really sampled from — so halving
its weight bytes (decode is memory-bound) buys speed at a small cost in acceptance.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Int8Weight:
    qweight: torch.Tensor  # [out, in] int8
    scales: torch.Tensor  # [out], w ~= qweight * scales[:, None]

    @property
    def shape(self):
        return self.qweight.shape

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return self.qweight.to(dtype) * self.scales.to(dtype)[:, None]


def quantize_int8(w: torch.Tensor) -> Int8Weight:
    wf = w.float()
    scales = wf.abs().amax(dim=1).clamp(min=1e-8) / 127.0  # [out]
    q = torch.round(wf / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return Int8Weight(q.contiguous(), scales.to(w.dtype))


def int8_linear(x: torch.Tensor, w: Int8Weight) -> torch.Tensor:
    """x [M, in] @ dequant(w)^T -> [M, out]. torch's CPU int8 weight-only kernel where it
    exists; a dequantised matmul elsewhere (CUDA, older torch)."""
    if x.device.type == "cpu" and hasattr(torch, "_weight_int8pack_mm"):
        return torch._weight_int8pack_mm(x.contiguous(), w.qweight, w.scales.to(x.dtype))
    return torch.nn.functional.linear(x, w.dequantize(x.dtype))


def quantize_model_int8(model) -> None:
    """Replace every layer weight (and an untied LM head) of a LlamaModel in place."""
    for layer in model.layers:
        layer.wqkv = quantize_int8(layer.wqkv)
        layer.wo = quantize_int8(layer.wo)
        layer.w_gate_up = quantize_int8(layer.w_gate_up)
        layer.w_down = quantize_int8(layer.w_down)
    model.lm_head = quantize_int8(model.lm_head)  # a copy: the embedding stays exact
