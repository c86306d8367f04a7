"""Turn a model name, folder, GGUF file or hub id into a local folder (torch-free: the
router resolves its tokenizer with it)."""

from __future__ import annotations

import re
from pathlib import Path

from specd.models.catalog import ALIASES, CATALOG, cache_root, is_ready, model_names

# a Hugging Face hub id: NAME or NAMESPACE/NAME, each of letters, digits, "_", "-", "."
# (not leading with "." or "-": "./x" and "../x" are paths), then llama-server's optional
# ":QUANT" (a GGUF of that quantisation)
HUB_ID = re.compile(r"(?P<repo>(?:\w[\w.-]*/)?\w[\w.-]*)(?::(?P<quant>\w[\w.-]*))?")
SPLIT = re.compile(r"-\d{5}-of-\d{5}\.gguf$")  # a part of a split GGUF


class ModelNotFound(LookupError):
    """What a user passed for a model (--model, --target, --tokenizer) names nothing specd
    can load."""


def resolve(spec: str | Path) -> Path:
    """Turn what a user passes (--target/--draft) into a local Hugging Face folder.

    Catalogued names are fetched and converted on first use (lazy, cached); a `.gguf` file
    is converted once into the cache; a folder is used as is; anything else is taken as a
    hub id and handed to huggingface_hub (the user's business: tests never do that).
    """
    name = ALIASES.get(str(spec), str(spec))
    if name in CATALOG:
        from specd.models.fetch import fetch_model

        return fetch_model(name)
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        from specd.models.fetch import convert_gguf

        folder = cache_root() / "models" / f"{path.stem}-{path.stat().st_size}"
        return folder if is_ready(folder) else convert_gguf(path, folder)
    if path.is_dir():
        return path
    if path.exists():
        raise ModelNotFound(f"{spec}: a file, neither a Hugging Face folder nor a .gguf file")
    hub = HUB_ID.fullmatch(name)
    if path.suffix == ".gguf" or hub is None:
        raise ModelNotFound(f"{spec}: no such folder or .gguf file")
    try:
        return _from_hub(hub["repo"], hub["quant"])
    except ModelNotFound:
        raise
    except Exception as exc:  # noqa: BLE001 - the hub's many errors, one answer for a user
        raise ModelNotFound(
            f"{spec}: not a catalogue name ({model_names()}), a folder or a .gguf file, and the "
            f"Hugging Face hub did not give it ({type(exc).__name__}: {exc})"
        ) from exc


def _from_hub(repo: str, quant: str | None) -> Path:
    """A hub repository's model: its safetensors folder, or where it has none or a quant is
    named (llama-server's `-hf REPO:QUANT`), one of its GGUF files, converted."""
    import huggingface_hub as hub

    if quant is None:
        patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
        folder = Path(hub.snapshot_download(repo, allow_patterns=patterns))
        if any(folder.glob("*.safetensors")):
            return folder
    files = hub.list_repo_files(repo)
    return resolve(hub.hf_hub_download(repo, gguf_file(repo, files, quant)))


def gguf_file(repo: str, files: list[str], quant: str | None) -> str:
    """The GGUF file llama-server's `-hf REPO[:QUANT]` takes: the one whose name holds
    QUANT (any case), else Q4_K_M's, else the first; never a vision projector."""
    ggufs = sorted(f for f in files if f.endswith(".gguf") and "mmproj" not in f.lower())
    wanted = (quant or "Q4_K_M").lower()
    named = [f for f in ggufs if wanted in Path(f).name.lower()]
    if quant and not named:
        raise ModelNotFound(f"{repo}: no GGUF file of {quant} in {', '.join(ggufs) or 'it'}")
    chosen = (named or ggufs or [None])[0]
    if chosen is None:
        raise ModelNotFound(f"{repo}: neither safetensors nor a GGUF file")
    if SPLIT.search(chosen):
        raise ModelNotFound(
            f"{repo}: {chosen} is one part of a split GGUF; merge its parts into one file "
            "(llama-gguf-split --merge) and pass that"
        )
    return chosen
