"""Find a model (catalogue name, HF folder, GGUF file, hub id) and load it for the forward."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specd.models import huge_pages
from specd.models.args import ModelArgs, default_device, parse_dtype, rope_inv_freq
from specd.models.catalog import is_ready
from specd.models.draft_cuts import four_bit_layers, trim_to_vocab
from specd.models.hf_config import load_config
from specd.models.llama import Layer, LlamaModel
from specd.models.native import kernel
from specd.models.paged_kv import kv_dtype
from specd.models.resolve import resolve  # noqa: F401 (re-exported)
from specd.models.weights import QUANTISED, choose, fuse, load_quantised, map_matrix


def load_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


# The special tokens llama.cpp ends a GGUF model's generation at beside its eos, known by
# their text (a GGUF lists no others; a Hugging Face folder lists its own in
# generation_config.json, e.g. Qwen2.5's <|im_end|> and <|endoftext|>): ends of a turn or
# text, and the markers a fill-in-the-middle model writes past the middle it fills
END_OF_TURN = frozenset(
    {
        "<|endoftext|>",
        "<|im_end|>",
        "<|eot_id|>",
        "<|eom_id|>",
        "<|end_of_text|>",
        "<|end|>",
        "<end_of_turn>",
        "<EOT>",
        "<|fim_pad|>",
        "<|repo_name|>",
        "<|file_sep|>",
        "<fim_pad>",
        "<file_sep>",
    }
)


def eos_token_ids(folder: Path, config) -> set[int]:
    """The tokens that end a generation: config.json's and generation_config.json's
    eos_token_id; for a folder converted from a GGUF, also its special tokens named in
    END_OF_TURN, as llama.cpp stops at them."""
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
    if is_ready(folder):  # converted from a GGUF (specd.models.fetch)
        ids |= _end_of_turn_tokens(folder / "tokenizer.json")
    return ids


def _end_of_turn_tokens(tokenizer_json: Path) -> set[int]:
    if not tokenizer_json.is_file():
        return set()
    added = json.loads(tokenizer_json.read_text()).get("added_tokens", [])
    return {t["id"] for t in added if t.get("special") and t.get("content") in END_OF_TURN}


class DenseTensors:
    """The folder's safetensors, read one tensor at a time (a quantised model never reads
    its dense matrices)."""

    def __init__(self, folder: Path):
        from safetensors import safe_open

        files = sorted(folder.glob("*.safetensors"))
        files = [f for f in files if not f.name.startswith("weights-")]  # our caches
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {folder}")
        self._where = {}
        for f in files:
            with safe_open(f, framework="pt") as h:
                for key in h.keys():
                    self._where[key.removeprefix("model.")] = (f, key)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def __call__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        f, key = self._where[name]
        with safe_open(f, framework="pt") as h:
            return h.get_tensor(key)

    def matrix_names(self) -> list[str]:
        return [n for n in self._where if n.endswith(".weight") and "norm" not in n]


def prepare_weights(folder: Path, fmt: str) -> Path:
    """Write `folder`'s cached `fmt` weights (int8/int4) now, without loading a model."""
    load_quantised(folder, fmt, load_config(folder), DenseTensors(folder))
    return folder / f"weights-{fmt}.safetensors"


class _Tensors:
    """Every weight of one model in its serving form: quantised matrices where `fmt` has
    them, the rest dense in `dtype` on `device`; q/k/v and gate/up fused. fp32 on a CPU
    that runs the dense kernel (specd.models.matmul) keeps a 16-bit checkpoint's matrices
    16-bit: the kernel widens each weight in a register, the same products from half the
    memory; norms and biases are fp32."""

    def __init__(self, folder: Path, dense: DenseTensors, quant: dict, dtype, device):
        self.folder, self.dense, self.quant = folder, dense, quant
        self.dtype, self.device = dtype, device
        fp32_cpu = dtype == torch.float32 and device.type == "cpu"
        self.keep_16bit = fp32_cpu and kernel() is not None

    def take(self, name: str, required: bool = True, matrix: bool = False):
        if name in self.quant:
            return self.quant.pop(name)
        if name not in self.dense:
            if required:
                raise KeyError(f"{self.folder}: weight {name!r} missing")
            return None
        stored = self.dense(name)
        dtype = self._matrix_dtype(stored.dtype) if matrix else self.dtype
        return stored.to(device=self.device, dtype=dtype).contiguous()

    def cat(self, fused: str, *names: str):
        if fused in self.quant:  # fused in the cache file (specd.models.weights.FUSED)
            return self.quant.pop(fused)
        if all(n in self.dense and n not in self.quant for n in names):
            # dense: each part converted straight into its rows of the fused matrix
            stored = [self.dense(n).to(self.device) for n in names]
            rows = sum(t.shape[0] for t in stored)
            dtypes = {t.dtype for t in stored}
            dtype = self._matrix_dtype(dtypes.pop()) if len(dtypes) == 1 else self.dtype
            out = torch.empty(rows, *stored[0].shape[1:], dtype=dtype, device=self.device)
            torch.cat(stored, dim=0, out=out)
            return out
        return fuse([self.take(n, matrix=True) for n in names])

    def _matrix_dtype(self, stored: torch.dtype) -> torch.dtype:
        return (
            stored if self.keep_16bit and stored in (torch.bfloat16, torch.float16) else self.dtype
        )

    def layer(self, i: int) -> Layer:
        p = f"layers.{i}."
        a = p + "self_attn."
        wqkv = self.cat(
            a + "qkv_proj.weight", a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"
        )
        qkv_bias = [self.take(a + f"{x}_proj.bias", False) for x in "qkv"]
        bqkv = None
        if all(b is not None for b in qkv_bias):  # a quantised kernel adds an fp32 bias
            quantised = not isinstance(wqkv, torch.Tensor)
            bqkv = torch.cat(qkv_bias).to(torch.float32 if quantised else self.dtype)
        return Layer(
            attn_norm=self.take(p + "input_layernorm.weight"),
            wqkv=wqkv,
            bqkv=None if bqkv is None else bqkv.contiguous(),
            wo=self.take(a + "o_proj.weight", matrix=True),
            bo=self.take(a + "o_proj.bias", required=False),
            mlp_norm=self.take(p + "post_attention_layernorm.weight"),
            w_gate_up=self.cat(
                p + "mlp.gate_up_proj.weight", p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"
            ),
            w_down=self.take(p + "mlp.down_proj.weight", matrix=True),
            q_norm=self.take(a + "q_norm.weight", required=False),
            k_norm=self.take(a + "k_norm.weight", required=False),
        )


def load_model(
    spec: str | Path,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    weights: str = "bf16",
    kv: str = "auto",
    dense: DenseTensors | None = None,
    draft_vocab: int | None = None,
) -> LlamaModel:
    """`weights`: bf16 (the model's dtype), int8, int4 or auto (specd.models.weights);
    `kv`: the K/V cache's dtype, auto, fp32, fp16 or bf16 (specd.models.paged_kv);
    `dense`: the dense tensors by name (default: the folder's safetensors; the GPU
    benchmark passes a random model's, built on the device from the folder's config);
    `draft_vocab`: a draft model, prepared with a drafter's cuts (specd.models.draft_cuts:
    every matrix at 4 bits under int4, its head trimmed to that many tokens, 0 = all;
    on a GPU, GEMMs of each step's own rows) before its weights are placed, once."""
    folder = resolve(spec)
    config = load_config(folder)
    args = ModelArgs.from_hf(config)
    dev = torch.device(device) if device is not None else default_device()
    dt = dtype if isinstance(dtype, torch.dtype) else parse_dtype(dtype, dev)
    cache_dtype = kv_dtype(kv, dt)  # before the weights: a bad name fails fast
    dense = DenseTensors(folder) if dense is None else dense
    fmt = choose(weights, dev)
    quant = load_quantised(folder, fmt, config, dense) if fmt in QUANTISED else {}
    tensors = _Tensors(folder, dense, quant, dt, dev)
    layers = [tensors.layer(i) for i in range(args.num_layers)]
    embed = tensors.take("embed_tokens.weight", matrix=True)
    lm_head = tensors.take("lm_head.weight", required=not args.tie_word_embeddings, matrix=True)
    inv_freq, scale = rope_inv_freq(config)
    norm = tensors.take("norm.weight")
    head = embed if lm_head is None else lm_head
    model = LlamaModel(args, embed, layers, norm, head, inv_freq, scale, dt, dev)
    model.weights = fmt
    model.kv_dtype = cache_dtype
    if draft_vocab is not None:
        if fmt == "int4":
            four_bit_layers(model)
        trim_to_vocab(model, folder, draft_vocab)
        if model.gpu is not None:  # a drafter only proposes: its rows need not round alike
            model.gpu.tile = 0
    if fmt in QUANTISED and huge_pages.place_model(model) and model.embed is not model.lm_head:
        model.embed = map_matrix(folder, fmt, "embed_tokens.weight")  # read a row at a time
    return model
