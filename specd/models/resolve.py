"""Turn a model name, folder, GGUF file or hub id into a local folder (torch-free: the
router resolves its tokenizer with it)."""

from __future__ import annotations

from pathlib import Path

from specd.models.catalog import ALIASES, CATALOG, cache_root, is_ready


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
    from huggingface_hub import snapshot_download

    return Path(
        snapshot_download(
            name, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
        )
    )
