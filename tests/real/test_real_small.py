import json

import pytest
import torch

from specd.models.catalog import CATALOG, SMALL_MODEL, cache_root
from specd.models.fetch import fetch_model
from specd.models.loader import load_model, load_tokenizer, prepare_weights
from specd.models.paged_kv import PagedKV
from specd.models.seq_input import SeqInput
from tests.conftest import real_model_or_skip


@pytest.mark.real
def test_smollm2_greedy_matches_transformers_generate():
    from transformers import AutoModelForCausalLM

    folder = real_model_or_skip(SMALL_MODEL)
    tok = load_tokenizer(folder)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "Write a Python function that reverses a string."}],
        add_generation_prompt=True,
        tokenize=True,
    )["input_ids"]
    model = load_model(folder, dtype="fp32", device="cpu")
    kv = PagedKV.for_model(model, num_blocks=32)
    kv.allocator.allocate(0)
    logits = model.forward(kv, [SeqInput(0, list(ids))])
    ours = []
    for _ in range(32):
        ours.append(int(logits[-1].argmax()))
        logits = model.forward(kv, [SeqInput(0, [ours[-1]])])

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)
    assert len(ref[0]) - len(ids) == 32, "prompt should run past 32 tokens"
    assert ours == ref[0, len(ids) :].tolist()


@pytest.mark.real
def test_a_fresh_cache_converts_the_small_models_gguf(tmp_path, monkeypatch, gguf_opens):
    """What a first `specd models fetch` or `specd up` does on a new machine: the GGUF
    (taken from the cache `make models` filled, else downloaded) converted through
    transformers into a dense folder, the same tensors and config as the cache's; its
    int4 weights then read the GGUF's blocks through the table the conversion wrote."""
    from safetensors.torch import load_file

    cached = real_model_or_skip(SMALL_MODEL)
    gguf = cache_root() / "gguf" / CATALOG[SMALL_MODEL].gguf_name
    monkeypatch.setenv("SPECD_CACHE", str(tmp_path))
    if gguf.exists():
        (tmp_path / "gguf").mkdir()
        (tmp_path / "gguf" / gguf.name).symlink_to(gguf)
    opened, _ = gguf_opens  # the file's header is parsed once, for config, tokenizer and weights
    folder = fetch_model(SMALL_MODEL)
    assert len(opened) == 1
    prepare_weights(folder, "int4")
    assert len(opened) == 1
    assert folder.is_relative_to(tmp_path) and (folder / ".specd-complete").exists()
    ours, theirs = load_file(folder / "model.safetensors"), load_file(cached / "model.safetensors")
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert (folder / "tokenizer.json").read_text() == (cached / "tokenizer.json").read_text()
    assert _config(folder) == _config(cached)


def _config(folder):
    """A converted model's config, less the stamp of the transformers that wrote it (a
    cache converted under an earlier release holds the same model)."""
    config = json.loads((folder / "config.json").read_text())
    config.pop("transformers_version", None)
    return config
