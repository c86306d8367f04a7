"""config.json read as it stands (specd.models.hf_config) gives the loader what transformers'
AutoConfig gives it: shape, RoPE, end-of-sequence ids, the heads GGUF blocks are unpermuted
by. Where the file leaves something to transformers (a default, a RoPE variant), AutoConfig
reads it."""

import json
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig

from specd.models.args import ModelArgs, rope_inv_freq
from specd.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET
from specd.models.loader import eos_token_ids, load_config
from tests.conftest import make_tiny, real_model_or_skip

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def what_the_loader_reads(folder, config):
    inv_freq, scale = rope_inv_freq(config)
    heads = (config.num_attention_heads, config.num_key_value_heads)
    return ModelArgs.from_hf(config), inv_freq, scale, eos_token_ids(folder, config), heads


def assert_as_autoconfig(folder, plain: bool):
    config = load_config(folder)
    assert isinstance(config, SimpleNamespace) == plain
    ours = what_the_loader_reads(folder, config)
    theirs = what_the_loader_reads(folder, AutoConfig.from_pretrained(folder))
    assert ours[0] == theirs[0]
    assert torch.equal(ours[1], theirs[1]) and ours[2:] == theirs[2:]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    out = {}
    for kind in ("qwen2", "llama", "qwen3"):  # plain RoPE; llama3 RoPE; a head_dim apart
        out[kind] = tmp_path_factory.mktemp(kind)
        make_tiny(kind, out[kind])
    return out


def rewritten(folders, tmp_path, kind: str, edit) -> object:
    """A copy of a tiny folder with its config.json edited by `edit(dict)`."""
    folder = tmp_path / f"{kind}-edited"
    shutil.copytree(folders[kind], folder)
    data = json.loads((folder / "config.json").read_text())
    edit(data)
    (folder / "config.json").write_text(json.dumps(data))
    return folder


def test_a_plain_rope_config_is_read_as_it_stands_and_a_variant_by_transformers(folders):
    assert_as_autoconfig(folders["qwen2"], plain=True)
    assert_as_autoconfig(folders["llama"], plain=False)


def older_form(rope_scaling):
    """The form Hugging Face hub folders written before transformers 5 have."""

    def edit(data):
        data["rope_theta"] = data.pop("rope_parameters")["rope_theta"]
        data["rope_scaling"] = rope_scaling

    return edit


@pytest.mark.parametrize("rope_scaling,plain", [(None, True), (LLAMA3_ROPE, False)])
def test_the_older_rope_form_is_read_alike(folders, tmp_path, rope_scaling, plain):
    assert_as_autoconfig(rewritten(folders, tmp_path, "qwen2", older_form(rope_scaling)), plain)


@pytest.mark.parametrize("field", ["tie_word_embeddings", "num_key_value_heads", "rms_norm_eps"])
def test_a_field_left_to_its_default_gets_the_architectures_default(folders, tmp_path, field):
    assert_as_autoconfig(rewritten(folders, tmp_path, "qwen2", lambda data: data.pop(field)), False)


def test_a_qwen3_config_is_read_as_it_stands_only_where_it_states_its_head_dim(folders, tmp_path):
    """Qwen3Config's default head_dim is 128, not hidden_size / heads."""
    assert_as_autoconfig(folders["qwen3"], plain=True)
    unstated = rewritten(folders, tmp_path, "qwen3", lambda data: data.pop("head_dim"))
    assert_as_autoconfig(unstated, plain=False)
    assert load_config(unstated).head_dim == 128


@pytest.mark.real
@pytest.mark.parametrize("name", [DEFAULT_TARGET, DEFAULT_DRAFT])
def test_the_default_pair_is_read_without_transformers(name):
    assert_as_autoconfig(real_model_or_skip(name), plain=True)


BUILD = """
import sys
from specd.config import VerifierConfig
from verifier_service.startup import build_engine
build_engine(VerifierConfig(model=sys.argv[1], dtype="float32"))
print("transformers" in sys.modules)
"""


@pytest.mark.parametrize("kind,imported", [("qwen2", False), ("llama", True)])
def test_a_verifier_builds_its_engine_without_transformers_where_the_config_allows(
    folders, kind, imported
):
    """A service's start spends no time importing transformers unless its config needs it
    (the tokenizer waits for the first constraint)."""
    out = subprocess.run(
        [sys.executable, "-c", BUILD, str(folders[kind])], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == str(imported)


def test_a_folder_from_a_gguf_ends_at_its_end_of_turn_tokens_as_llama_cpp(tmp_path):
    """A GGUF names one eos; llama.cpp also ends at the special tokens whose text marks an
    end of turn or text (Qwen2.5's <|endoftext|> beside <|im_end|>). A Hugging Face
    folder's own list (config and generation_config) is taken as it stands."""
    added = [
        {"id": 0, "content": "<|endoftext|>", "special": True},
        {"id": 1, "content": "<|im_start|>", "special": True},
        {"id": 2, "content": "<|im_end|>", "special": True},
        {"id": 3, "content": "<|eot_id|>", "special": False},  # not a special token
        {"id": 4, "content": "<|fim_prefix|>", "special": True},
        {"id": 5, "content": "<|file_sep|>", "special": True},  # past a filled middle
    ]
    (tmp_path / "tokenizer.json").write_text(json.dumps({"added_tokens": added}))
    config = SimpleNamespace(eos_token_id=2)
    assert eos_token_ids(tmp_path, config) == {2}  # a Hugging Face folder
    (tmp_path / ".specd-complete").write_text("model.gguf\n")  # converted from a GGUF
    assert eos_token_ids(tmp_path, config) == {0, 2, 5}
