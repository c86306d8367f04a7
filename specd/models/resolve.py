"""Turn a model name, folder, GGUF file or hub id into a local folder (torch-free: the
router resolves its tokenizer with it)."""

from __future__ import annotations

import re
from pathlib import Path

from specd.models.catalog import ALIASES, CATALOG, cache_root, is_ready, model_names

# a Hugging Face hub id: NAME or NAMESPACE/NAME, each of letters, digits, "_", "-", "."
# (not leading with "." or "-": "./x" and "../x" are paths)
HUB_ID = re.compile(r"(?:\w[\w.-]*/)?\w[\w.-]*")


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
    if path.suffix == ".gguf" or not HUB_ID.fullmatch(name):
        raise ModelNotFound(f"{spec}: no such folder or .gguf file")
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
    try:
        return Path(snapshot_download(name, allow_patterns=patterns))
    except Exception as exc:  # noqa: BLE001 - the hub's many errors, one answer for a user
        raise ModelNotFound(
            f"{spec}: not a catalogue name ({model_names()}), a folder or a .gguf file, and the "
            f"Hugging Face hub did not give it ({type(exc).__name__}: {exc})"
        ) from exc
