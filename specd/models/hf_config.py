"""A model folder's config: its config.json read as it stands where that says everything the
loader uses, transformers' `AutoConfig` otherwise.

`AutoConfig` fills each architecture's defaults and normalises RoPE variants (Llama 3's
`llama3` scaling, linear, yarn, ...), but importing transformers costs a service ~1.5 s
of its start. A Llama-family config.json that states every field specd reads, with plain
RoPE, needs neither: the file's own values are what `AutoConfig` would return for them
(tests/unit/test_hf_config.py compares the two). Anything else goes to `AutoConfig`."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from specd.models.args import SUPPORTED_TYPES

# the fields specd.models.args.ModelArgs reads that have no default specd could know
STATED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",  # (Qwen2Config's default is 32, not the heads)
    "rms_norm_eps",
    "max_position_embeddings",
    "tie_word_embeddings",
)


def load_config(folder: Path):
    data = json.loads((Path(folder) / "config.json").read_text())
    plain = as_stated(data)
    if plain is not None:
        return plain
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder)


def as_stated(data: dict) -> SimpleNamespace | None:
    """`data` as attributes, or None where `AutoConfig` must decide: an architecture specd
    does not run, a field left to its default, RoPE other than the plain kind (in either
    the `rope_parameters` form transformers 5 writes or the older `rope_theta` +
    `rope_scaling`)."""
    if data.get("model_type") not in SUPPORTED_TYPES or any(data.get(k) is None for k in STATED):
        return None
    if data["model_type"] == "qwen3" and data.get("head_dim") is None:
        return None  # Qwen3Config's default head_dim is 128, not hidden_size / heads
    rope = data.get("rope_parameters")
    if rope is None:
        if data.get("rope_scaling") is not None or data.get("rope_theta") is None:
            return None
        rope = {"rope_theta": data["rope_theta"], "rope_type": "default"}
    if set(rope) != {"rope_theta", "rope_type"} or rope["rope_type"] != "default":
        return None
    return SimpleNamespace(**{**data, "rope_parameters": dict(rope)})
