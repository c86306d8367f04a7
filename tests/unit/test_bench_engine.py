"""`specd bench engine` on a tiny model: it measures the weights it is asked for."""

import json

import pytest

from bench.engine import main
from tests.conftest import make_tiny


@pytest.mark.parametrize("weights", ["bf16", "int8"])
def test_the_engine_bench_measures_the_weights_it_is_given(
    cpu_kernels, tmp_path_factory, tmp_path, weights
):
    folder = tmp_path_factory.mktemp("bench-engine")
    make_tiny("llama", folder)
    out = tmp_path / "engine.json"
    sizes = ["--context", "32", "--prompt-tokens", "8", "--new-tokens", "4", "--repeats", "1"]
    args = ["--model", str(folder), "--dtype", "fp32", "--weights", weights, "--no-hf", *sizes]
    assert main([*args, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["weights"] == weights and report["decode_tokens_per_s"]["specd"] > 0
    assert set(report["verification_ratio"]) == {"1", "2", "4", "6", "8", "16"}
