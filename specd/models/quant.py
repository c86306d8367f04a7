"""Weight-only int8 for the drafter: per-output-channel symmetric scales.

The target never uses this: its distribution is the contract. The drafter's is free —
rejection sampling is exact for whatever q the drafter really sampled from — so halving
its weight bytes (decode is memory-bound) buys speed at a small cost in acceptance.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch


@dataclass
class Int8Weight:
    qweight: torch.Tensor  # [out, in] int8
    scales: torch.Tensor  # [out], w ~= qweight * scales[:, None]
    packed: object = None  # the same integers prepacked for fbgemm (CPU), see pack_for_cpu

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


PACKED_MAX_ROWS = 4  # a batch of draft steps or a round's catch-up, never a prompt


def pack_for_cpu(w: Int8Weight) -> Int8Weight:
    """Prepack the weight for fbgemm's dynamic int8 linear where torch has fbgemm (x86):
    it reads int8 weights at ~22 GB/s on this machine against ~12 GB/s for the weight-only
    kernel (BENCHMARKS.md). Activations are quantised per call (7-bit, per tensor), which
    moves the drafter's q a little; the drafter's q is free, exactness never depends on it.
    Used for a few rows only (int8_linear)."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return w
    zeros = torch.zeros(len(w.scales), dtype=torch.long)
    try:
        with warnings.catch_warnings():
            # torch 2.13 deprecates quantized tensors (pytorch#184982); without them we
            # keep the weight-only kernel below
            warnings.simplefilter("ignore", UserWarning)
            qt = torch.quantize_per_channel(
                w.dequantize(torch.float32), w.scales.double(), zeros, 0, torch.qint8
            )
            packed = torch.ops.quantized.linear_prepack(qt, None)
    except (AttributeError, RuntimeError):
        return w
    return Int8Weight(w.qweight, w.scales, packed)


def int8_linear(x: torch.Tensor, w: Int8Weight) -> torch.Tensor:
    """x [M, in] @ dequant(w)^T -> [M, out]. Draft steps (M <= PACKED_MAX_ROWS): fbgemm's
    dynamic int8 linear when packed. More rows (a prompt): its one activation scale per
    tensor would be set by the largest row (Qwen's outlier tokens wreck the rest), so
    torch's CPU int8 weight-only kernel where it exists; else a dequantised matmul (CUDA)."""
    if w.packed is not None and x.device.type == "cpu" and x.shape[0] <= PACKED_MAX_ROWS:
        y = torch.ops.quantized.linear_dynamic(x.float().contiguous(), w.packed, True)
        return y.to(x.dtype)
    if x.device.type == "cpu" and hasattr(torch, "_weight_int8pack_mm"):
        return torch._weight_int8pack_mm(x.contiguous(), w.qweight, w.scales.to(x.dtype))
    return torch.nn.functional.linear(x, w.dequantize(x.dtype))


def quantize_model_int8(model, pack: bool = True) -> None:
    """Replace every layer weight and the LM head of a LlamaModel in place (prepacked for
    fbgemm on CPU unless `pack` is False)."""

    def q(w):
        w = quantize_int8(w)
        return pack_for_cpu(w) if pack and model.device.type == "cpu" else w

    for layer in model.layers:
        layer.wqkv = q(layer.wqkv)
        layer.wo = q(layer.wo)
        layer.w_gate_up = q(layer.w_gate_up)
        layer.w_down = q(layer.w_down)
    model.lm_head = q(model.lm_head)  # a copy: the embedding stays exact
