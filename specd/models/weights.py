"""Weight formats: which one a model runs in, and the cached quantised matrices.

`bf16` keeps the model's own dtype. `int8` and `int4` hold every matrix in the group-
quantised format of specd.models.qlinear; `int4` keeps a GGUF's Q4_K and Q6_K blocks as
they are (4 and 6 bits: llama.cpp's Q4_K_M keeps the LM head and half the down
projections in Q6_K), takes 8 bits where the GGUF spent more than 5 in another type (see
gguf_blocks), and 8 for the LM head of a dense source.
`auto` is int4 on a CPU that runs the kernel, else the model's dtype (CUDA, or neither
AVX512-VNNI nor AVX2), said in one log line.

The quantised matrices are converted once, from the GGUF the folder was made from where
there is one (its blocks kept as they are), else from the dense weights, and cached next to
them as `weights-<format>.safetensors`: a restart reads that file and nothing dense. The
file holds q/k/v and gate/up already fused (`FUSED`), so a model maps its matrices from
the file as they are: fusing at load time would copy them and keep the parts' pages
resident too (~0.5 GB of the 1.5B target's resident memory).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch

from specd.config import WEIGHT_FORMATS as FORMATS
from specd.models import native
from specd.models.qlinear import QWeight, fits, quantize

log = logging.getLogger(__name__)

QUANTISED = ("int8", "int4")
_HEADS = ("lm_head.weight", "embed_tokens.weight")
# a fused matrix's name <- the names of its parts, within one layer
FUSED = {
    "self_attn.qkv_proj.weight": (
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
    ),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}
_LAYOUT = "fused"  # the cache file's metadata says which layout it holds
# and which conversion wrote it: 5 keeps Q6_K's two-level scales, 4 Q4_K's (before, each
# sub-block's d * sc was rounded to fp16), 3 every Q6_K tensor's codes and scales (2
# requantised a Q6_K LM head at 6 bits, 1 (unstamped) at 8); a file from another
# conversion is converted again
CONVERSION = 5


def choose(requested: str, device: torch.device) -> str:
    if requested not in FORMATS:
        raise ValueError(f"weights must be one of {', '.join(FORMATS)}, got {requested!r}")
    if requested == "bf16":
        return requested
    if device.type != "cpu":
        log.warning("weights %s: no quantised kernel on %s; running bf16", requested, device)
        return "bf16"
    if native.kernel() is None:
        log.warning("weights %s: this CPU cannot run the int8/int4 kernel; running bf16", requested)
        return "bf16"
    return "int4" if requested == "auto" else requested


def source_gguf(folder: Path) -> Path | None:
    """The GGUF file a converted folder came from (written by specd.models.fetch)."""
    from specd.models.catalog import cache_root

    for marker in (folder / "source-gguf", folder / ".specd-complete"):
        if marker.exists():
            name = marker.read_text().strip()
            for path in (Path(name), cache_root() / "gguf" / name):
                if path.is_file():
                    return path
    return None


def load_quantised(folder: Path, fmt: str, config, dense) -> dict[str, QWeight]:
    """The matrices of `folder` in `fmt`, by Hugging Face name (without the "model."
    prefix); `dense(name)` reads one dense tensor when there is no GGUF to convert from."""
    cache = folder / f"weights-{fmt}.safetensors"
    if cache.exists():
        mats, layout, conversion = _read(cache)
        if conversion == CONVERSION:
            if layout != _LAYOUT:  # written before the fused layout: fuse and rewrite, once
                mats = fuse_layers(mats)
                log.warning("rewriting %s with q/k/v and gate/up fused (once)", cache)
                _write(cache, mats)
            return mats
        log.warning("%s was written by an older conversion", cache)
    gguf = source_gguf(folder)
    log.warning("converting %s weights to %s (once) -> %s", folder.name, fmt, cache)
    if gguf is not None:
        from specd.models.gguf_blocks import TABLE, read_gguf

        mats = read_gguf(gguf, fmt, config, folder / TABLE)
    else:
        mats = {}
        for name in dense.matrix_names():
            w = dense(name)
            if w.dim() == 2 and fits(tuple(w.shape)):
                bits = 8 if fmt == "int8" or name in _HEADS else 4
                mats[name] = quantize(w, bits)
    mats = fuse_layers(mats)
    _write(cache, mats)
    return mats


def _write(path: Path, mats: dict[str, QWeight]) -> None:
    from safetensors.torch import save_file

    meta = {name: [w.bits, *w.shape] for name, w in mats.items()}
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # replicas converting at once: one each
    records = {name: w.records for name, w in mats.items()}
    stamp = {"layout": _LAYOUT, "specd-conversion": str(CONVERSION)}
    save_file(records, tmp, metadata={"specd": json.dumps(meta), **stamp})
    tmp.rename(path)  # a process still mapping the old file keeps its (unlinked) pages


def _read(path: Path) -> tuple[dict[str, QWeight], str | None, int]:
    """The file's matrices, mapped from it (not copied), its layout and conversion."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        meta = f.metadata()
        mats = {
            name: QWeight(f.get_tensor(name), bits, (n, k))
            for name, (bits, n, k) in json.loads(meta["specd"]).items()
        }
        return mats, meta.get("layout"), int(meta.get("specd-conversion", 1))


def map_matrix(folder: Path, fmt: str, name: str) -> QWeight:
    """One matrix of the cached file in a mapping of its own: a model whose other matrices
    were copied into huge pages (specd.models.huge_pages) keeps its embedding mapped this
    way, so the first mapping, whose pages the copy read, goes with its views."""
    from safetensors import safe_open

    with safe_open(folder / f"weights-{fmt}.safetensors", framework="pt") as f:
        bits, n, k = json.loads(f.metadata()["specd"])[name]
        return QWeight(f.get_tensor(name), bits, (n, k))


def fuse_layers(mats: dict[str, QWeight]) -> dict[str, QWeight]:
    """Replace each layer's q/k/v and gate/up by one matrix where `fuse` can (`FUSED`)."""
    out = dict(mats)
    for name in mats:
        for fused, parts in FUSED.items():
            if not name.endswith(parts[0]):
                continue
            prefix = name[: -len(parts[0])]
            names = [prefix + p for p in parts]
            if all(n in out for n in names):
                one = fuse([out[n] for n in names])
                if isinstance(one, QWeight):
                    out[prefix + fused] = one
                    for n in names:
                        del out[n]
    return out


def fuse(parts: list) -> QWeight | list:
    """Stack matrices that share an input (q/k/v, gate/up) into one kernel call where they
    share a bit width (records stack along the row tiles); else keep them a list."""
    if len({p.bits for p in parts}) == 1 and all(isinstance(p, QWeight) for p in parts):
        records = torch.cat([p.records for p in parts], dim=0)
        return QWeight(records, parts[0].bits, (sum(p.shape[0] for p in parts), parts[0].shape[1]))
    return list(parts)
