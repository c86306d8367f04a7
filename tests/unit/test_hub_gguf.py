"""A hub repository of GGUF files, as llama-server's `-hf REPO[:QUANT]` names one: the file
it would take is downloaded and converted (the hub stood in for: tests reach no network)."""

from __future__ import annotations

import huggingface_hub
import pytest

import specd.models.fetch as fetch
from launcher.cli_parser import build_parser
from specd.models.resolve import ModelNotFound, gguf_file, resolve

REPO = [
    "README.md",
    "qwen2.5-coder-1.5b-instruct-fp16.gguf",
    "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    "qwen2.5-coder-1.5b-instruct-q8_0.gguf",
    "mmproj-q8_0.gguf",
]


def test_the_file_llama_server_would_take():
    assert gguf_file("r", REPO, "Q8_0") == "qwen2.5-coder-1.5b-instruct-q8_0.gguf"
    assert gguf_file("r", REPO, "fp16") == "qwen2.5-coder-1.5b-instruct-fp16.gguf"
    assert gguf_file("r", REPO, None) == "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"  # its default
    no_q4 = [f for f in REPO if "q4_k_m" not in f]
    assert gguf_file("r", no_q4, None) == "qwen2.5-coder-1.5b-instruct-fp16.gguf"  # the first
    with pytest.raises(ModelNotFound, match="r: no GGUF file of Q2_K in qwen"):
        gguf_file("r", REPO, "Q2_K")
    with pytest.raises(ModelNotFound, match="r: neither safetensors nor a GGUF file"):
        gguf_file("r", ["README.md", "mmproj-f16.gguf"], None)  # a projector is no model
    split = ["m-q8_0-00001-of-00002.gguf", "m-q8_0-00002-of-00002.gguf"]
    with pytest.raises(ModelNotFound, match="one part of a split GGUF"):
        gguf_file("r", split, "q8_0")


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """A stand-in hub holding REPO (no safetensors), and the conversions asked for."""
    asked, converted = [], []

    def snapshot_download(repo, allow_patterns):
        folder = tmp_path / "snapshot"
        folder.mkdir(exist_ok=True)
        (folder / "config.json").write_text("{}")
        return str(folder)

    def hf_hub_download(repo, filename):
        asked.append((repo, filename))
        path = tmp_path / filename
        path.write_bytes(b"GGUF")
        return str(path)

    def convert_gguf(path, folder):
        converted.append(path.name)
        return folder

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr(huggingface_hub, "list_repo_files", lambda repo: REPO)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    monkeypatch.setattr(fetch, "convert_gguf", convert_gguf)
    monkeypatch.setenv("SPECD_CACHE", str(tmp_path / "cache"))
    return asked, converted, tmp_path


def test_a_repo_and_quant_is_that_gguf_converted(hub):
    asked, converted, _ = hub
    resolve("ggml-org/Qwen2.5-Coder-1.5B-GGUF:Q8_0")
    assert asked == [("ggml-org/Qwen2.5-Coder-1.5B-GGUF", "qwen2.5-coder-1.5b-instruct-q8_0.gguf")]
    assert converted == ["qwen2.5-coder-1.5b-instruct-q8_0.gguf"]
    # without a quant: the repo has no safetensors, so its Q4_K_M GGUF
    resolve("ggml-org/Qwen2.5-Coder-1.5B-GGUF")
    assert converted[-1] == "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"


def test_a_repo_with_safetensors_is_its_folder(hub):
    asked, converted, tmp_path = hub
    (tmp_path / "snapshot").mkdir()
    (tmp_path / "snapshot" / "model.safetensors").write_bytes(b"")
    assert resolve("org/model") == tmp_path / "snapshot"
    assert (asked, converted) == ([], [])


def test_llama_servers_hub_flags_name_the_pair():
    up = build_parser().parse_args(["up", "-hf", "org/big:Q8_0", "-hfd", "org/small:Q8_0"])
    assert (up.target, up.draft) == ("org/big:Q8_0", "org/small:Q8_0")
    with pytest.raises(SystemExit):  # the target named twice
        build_parser().parse_args(["up", "-hf", "org/big", "-m", "other.gguf"])
