"""GGUF tensors straight into the group-quantised format (specd.models.qlinear).

GGUF blocks of 4 and 6 bits keep their codes and scales (in `int4` mode). A Q4_K
super-block is 8 sub-blocks of 32 four-bit codes, each with a 6-bit scale and min under
the block's fp16 d and dmin, so w = (d * sc) * q - (dmin * m): our 4-bit format's
super-block as it is (`TwoLevel`), exact. A Q6_K super-block is 16 sub-blocks of 16
six-bit codes, w = (d * sc) * (q - 32) with an int8 sc: our 6-bit format's, exact too.
llama.cpp's Q4_K_M keeps the LM head, half the down projections and some v projections
in Q6_K. Other types (Q4_1, Q5_0, Q8_0, float) are dequantised by the `gguf` package and
quantised again: at 8 bits where the GGUF spent more than 5 bits on the tensor, else at 4.

GGUF names map to Hugging Face names as transformers maps them; Llama-architecture files
store q/k rows permuted for llama.cpp's RoPE, undone here on whole rows (exact).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import torch

from specd.models.qlinear import QWeight, TwoLevel, fits, pack, quantize, six_bit_mins

TABLE = "gguf-tensors.json"  # a converted folder's table of its GGUF's tensors (`tensors_of`)
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# GGUF types of more than 5 bits a weight without a kept form (`_EXACT`): int4 quantises
# them again at 8 (others at 4)
_WIDE = {"Q8_0", "Q8_1", "Q8_K", "F16", "BF16", "F32"}


def hf_name(gguf_name: str) -> str | None:
    """'blk.3.ffn_up.weight' -> 'layers.3.mlp.up_proj.weight' (matrices only)."""
    if gguf_name == "token_embd.weight":
        return "embed_tokens.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES and parts[3] == "weight":
        return f"layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.weight"
    return None


def q4_k(blocks: np.ndarray) -> tuple[np.ndarray, tuple, tuple]:
    """Q4_K blocks uint8 [B, 144] -> codes [B, 256], then the scales and the mins, each as
    (fp16 value [B, 1] as fp32, 6-bit integers [B, 8])."""
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # [B, 1]
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    packed = blocks[:, 4:16].reshape(-1, 3, 4)  # 6-bit scale and min of 8 sub-blocks
    lo, hi, mix = packed[:, 0], packed[:, 1], packed[:, 2]
    sc = np.concatenate([lo & 0x3F, (mix & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([hi & 0x3F, (mix >> 4) | ((hi >> 2) & 0x30)], axis=-1)
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32)  # 4 chunks of 64: low nibbles, then high
    codes = (qs >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    return codes.reshape(-1, 256), (d, sc), (dmin, mn)


def q6_k(blocks: np.ndarray) -> tuple[np.ndarray, tuple, None]:
    """Q6_K blocks uint8 [B, 210] -> codes [B, 256] (0..63), then the scales as (fp16 d
    [B, 1] as fp32, int8 per 16 codes [B, 16]), and no mins (32 times the scales).
    A block: 128 bytes of low nibbles, 64 of top bit pairs, 16 int8 sub-block scales, fp16
    d. Each 128-code half of the block takes 64 low-nibble bytes (byte i: code i in its low
    nibble, code 64 + i in its high one) and 32 top bytes (byte i: codes i, 32 + i, 64 + i,
    96 + i in bit pairs 0-1 .. 6-7)."""
    low = blocks[:, :128].reshape(-1, 2, 1, 64)
    low = (low >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F  # [B, 2, 2, 64]
    top = blocks[:, 128:192].reshape(-1, 2, 1, 32)
    top = (top >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 0x03
    codes = low.reshape(-1, 256) | (top.reshape(-1, 256) << 4)
    sc = blocks[:, 192:208].copy().view(np.int8)
    d = blocks[:, 208:210].copy().view(np.float16).astype(np.float32)  # [B, 1]
    return codes, (d, sc), None


# type: (bytes a block, decoder, bits)
_EXACT = {"Q4_K": (144, q4_k, 4), "Q6_K": (210, q6_k, 6)}


def to_qweight(tensor, mode: str) -> QWeight | None:
    """One GGUFReader tensor -> QWeight in `mode` ('int4' or 'int8'); None when its shape
    does not fit the kernel's tiles (it then stays dense)."""
    kind = tensor.tensor_type.name
    rows, cols = int(tensor.shape[1]), int(tensor.shape[0])  # GGUF lists shape inner-first
    if not fits((rows, cols)):
        return None
    if mode == "int4" and kind in _EXACT:
        size, decode, bits = _EXACT[kind]
        codes, d, m = decode(np.asarray(tensor.data).reshape(-1, size))
        q = torch.from_numpy(codes.reshape(rows, cols))
        # (fp16 value, integers) per super-block: kept as they are
        d = TwoLevel(_groups(d[0], rows), _groups(d[1], rows), 8 if bits == 4 else 16)
        if bits == 6:
            return pack(q, d, six_bit_mins(d), bits)
        return pack(q, d, TwoLevel(_groups(m[0], rows), _groups(m[1], rows)), bits)
    dense = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
    bits = 8 if (mode == "int8" or kind in _WIDE) else 4
    return quantize(torch.from_numpy(np.ascontiguousarray(dense)).reshape(rows, cols), bits)


def _groups(per_group: np.ndarray, rows: int) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(per_group).reshape(rows, -1))


def unpermute_rows(w: QWeight, n_head: int) -> QWeight:
    """Undo llama.cpp's q/k row order (HF's `reverse_permute`) on whole rows."""
    n, _ = w.shape
    dim = n // n_head // 2
    return w.take_rows(torch.arange(n).view(n_head, dim, 2).transpose(1, 2).reshape(n))


def read_gguf(path: Path, mode: str, config, table: Path) -> dict[str, QWeight]:
    """Every matrix of a GGUF file that fits the format, by Hugging Face name; `table`:
    where its tensor table is kept (`tensors_of`)."""
    arch, tensors = tensors_of(path, table)
    out = {}
    for t in tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        w = to_qweight(t, mode)
        if w is None:
            continue
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            heads = config.num_attention_heads if ".q_proj." in name else config.num_key_value_heads
            w = unpermute_rows(w, heads)
        out[name] = w
    return out


def open_gguf(path: Path) -> PlainReader:
    """A `gguf.GGUFReader` of `path` over a plain ndarray view of its map (`PlainReader`)."""
    return PlainReader(str(path))


class PlainReader(gguf.GGUFReader):
    """The reader slices its map a few times for each metadata value it parses, and every
    slice of an `np.memmap` runs the subclass's Python hooks: with Qwen's 151,936
    vocabulary strings and merges that was most of an open (7.5 s of 12 on a 2-core
    Xeon), and of the `gguf` package's dequantising, which splits each tensor into rows.
    The view reads the same bytes from the same map, which it keeps open."""

    @property
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, mapped: np.ndarray) -> None:
        self._plain = mapped.view(np.ndarray)


def write_table(reader, path: Path, table: Path) -> dict:
    """The architecture and tensors (name, type, shape, where its bytes start) an open
    `gguf.GGUFReader` of `path` found, written to `table` with the file's size and time."""
    stat = path.stat()
    entry = {
        "file": [stat.st_size, stat.st_mtime_ns],
        "architecture": bytes(reader.fields["general.architecture"].parts[-1]).decode(),
        "tensors": [
            [t.name, int(t.tensor_type), [int(n) for n in t.shape], int(t.data_offset)]
            for t in reader.tensors
        ],
    }
    tmp = table.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(entry))
    tmp.rename(table)
    return entry


def tensors_of(path: Path, table: Path) -> tuple[str, list[SimpleNamespace]]:
    """(architecture, tensors) of a GGUF file, each tensor's bytes mapped from the file.
    A reader parses every metadata value in Python as it opens a file (`open_gguf`): it
    opens the file once, for the table kept at `table`; the tensors are then read through
    the table while the file's size and time are the ones it names."""
    stat = path.stat()
    entry = json.loads(table.read_text()) if table.exists() else None
    if entry is None or entry["file"] != [stat.st_size, stat.st_mtime_ns]:
        entry = write_table(open_gguf(path), path, table)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = []
    for name, kind, shape, start in entry["tensors"]:
        kind = gguf.GGMLQuantizationType(kind)
        block, size = gguf.GGML_QUANT_SIZES[kind]
        n_bytes = int(np.prod(shape)) * size // block
        raw = data[start : start + n_bytes]  # the reader's rows, as bytes
        tensors.append(SimpleNamespace(name=name, tensor_type=kind, shape=shape, data=raw))
    return entry["architecture"], tensors
