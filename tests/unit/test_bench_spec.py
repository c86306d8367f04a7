"""`specd bench spec` on a tiny pair: each config's draft model in the weights it names."""

import json

import pytest

from bench import speculative
from tests.conftest import make_tiny


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_the_spec_bench_drafts_with_the_weights_a_config_names(
    cpu_kernels, tmp_path_factory, tmp_path, monkeypatch, fmt
):
    folder = tmp_path_factory.mktemp("bench-spec")
    make_tiny("llama", folder)
    loaded, original = [], speculative.load_draft_model

    def load(*args, **kwargs):
        model = original(*args, **kwargs)
        loaded.append(model.weights)
        return model

    monkeypatch.setattr(speculative, "load_draft_model", load)
    monkeypatch.setattr(speculative, "load_tokenizer", lambda _folder: None)  # none in a tiny one
    monkeypatch.setattr(speculative, "load_workload", lambda *_a, **_k: [[1, 2, 3, 4, 5]])
    out = tmp_path / "spec.json"
    configs = f"off,draft:2,draft-{fmt}:2"
    args = ["--target", str(folder), "--draft", str(folder), "--dtype", "fp32"]
    args += ["--configs", configs, "--max-new-tokens", "6", "--json", str(out)]
    assert speculative.main(args) == 0
    assert loaded == ["bf16", fmt]
    results = json.loads(out.read_text())["results"]
    assert results[f"draft-{fmt}:2"]["outputs"] == results["off"]["outputs"]
