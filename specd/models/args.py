"""Model shape and numerics read from a Hugging Face config; dtype and device choice."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

from specd.config import DTYPE_SPELLINGS
from specd.models.native import cpu_isa

SUPPORTED_TYPES = ("llama", "qwen2", "qwen3", "mistral")


@dataclass(frozen=True)
class ModelArgs:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int

    @classmethod
    def from_hf(cls, config) -> ModelArgs:
        if config.model_type not in SUPPORTED_TYPES:
            raise ValueError(
                f"model_type {config.model_type!r} is not a Llama-family model "
                f"(supported: {', '.join(SUPPORTED_TYPES)})"
            )
        heads = config.num_attention_heads
        return cls(
            model_type=config.model_type,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            rms_norm_eps=config.rms_norm_eps,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            max_position_embeddings=config.max_position_embeddings,
        )


def rope_inv_freq(config) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling, from transformers' own RoPE table
    (covers Llama 3.x `llama3` scaling, linear, dynamic, yarn, ...). `config`: a
    transformers config, or config.json's plain-RoPE fields (specd.models.hf_config)."""
    if hasattr(config, "standardize_rope_params"):
        config.standardize_rope_params()
    params = config.rope_parameters
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
        return inv_freq.float(), float(scaling)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    base = params["rope_theta"]
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    return inv_freq, 1.0


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@cache
def cpu_supports_bf16() -> bool:
    """bf16 pays on a CPU with native bf16 dot products (AVX512-BF16 or AMX), which run
    the AVX512 kernels (`SPECD_ISA=avx2` makes such a CPU take an AVX2 host's defaults)."""
    if cpu_isa() != "avx512":
        return False
    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    if probe is not None and probe():
        return True
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(amx and amx())


def default_dtype(device: torch.device) -> torch.dtype:
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_supports_bf16() else torch.float32


def parse_dtype(name: str | None, device: torch.device) -> torch.dtype:
    if name in (None, "", "auto"):
        return default_dtype(device)
    table = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
    dtype = table.get(DTYPE_SPELLINGS.get(name, name))
    if dtype is None:
        raise ValueError(f"unknown dtype {name!r}; use auto, bf16, fp32 or fp16")
    return dtype
