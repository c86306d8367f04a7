"""Find a model (catalogue name, HF folder, GGUF file, hub id) and load it for the forward."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specd.models.args import ModelArgs, default_device, parse_dtype, rope_inv_freq
from specd.models.llama import Layer, LlamaModel
from specd.models.resolve import ALIASES, resolve  # noqa: F401 (re-exported)


def load_config(folder: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder)


def load_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def eos_token_ids(folder: Path, config) -> set[int]:
    ids: set[int] = set()
    sources = [getattr(config, "eos_token_id", None)]
    gen = folder / "generation_config.json"
    if gen.exists():
        sources.append(json.loads(gen.read_text()).get("eos_token_id"))
    for value in sources:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))
    return ids


def _read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    return state


def load_model(
    spec: str | Path,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
) -> LlamaModel:
    folder = resolve(spec)
    config = load_config(folder)
    args = ModelArgs.from_hf(config)
    dev = torch.device(device) if device is not None else default_device()
    dt = dtype if isinstance(dtype, torch.dtype) else parse_dtype(dtype, dev)
    raw = _read_safetensors(folder)
    state = {k.removeprefix("model."): v for k, v in raw.items()}

    def take(name: str, required: bool = True) -> torch.Tensor | None:
        t = state.pop(name, None)
        if t is None and required:
            raise KeyError(f"{folder}: weight {name!r} missing")
        return None if t is None else t.to(device=dev, dtype=dt).contiguous()

    def cat(*names: str, required: bool = True) -> torch.Tensor | None:
        parts = [take(n, required) for n in names]
        return None if any(p is None for p in parts) else torch.cat(parts, dim=0).contiguous()

    layers = []
    for i in range(args.num_layers):
        p = f"layers.{i}."
        a = p + "self_attn."
        layers.append(
            Layer(
                attn_norm=take(p + "input_layernorm.weight"),
                wqkv=cat(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),
                bqkv=cat(a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias", required=False),
                wo=take(a + "o_proj.weight"),
                bo=take(a + "o_proj.bias", required=False),
                mlp_norm=take(p + "post_attention_layernorm.weight"),
                w_gate_up=cat(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                w_down=take(p + "mlp.down_proj.weight"),
            )
        )
    embed = take("embed_tokens.weight")
    lm_head = take("lm_head.weight", required=not args.tie_word_embeddings)
    inv_freq, scale = rope_inv_freq(config)
    return LlamaModel(
        args,
        embed,
        layers,
        take("norm.weight"),
        embed if lm_head is None else lm_head,
        inv_freq,
        scale,
        dt,
        dev,
    )
