"""The serving flags of a vLLM, SGLang or llama-server launch command on `specd up`: each
under its peers' names reaches the role that owns it, and the API key reaches the router
in a file only its user may read."""

from __future__ import annotations

import os
import stat

import pytest

from launcher.cli_parser import build_parser, serve_config
from launcher.local_cluster import CLI, _token_file, cluster_children
from launcher.peer_flags import api_key
from specd.config import ConfigError


def _configs(*flags: str, token_file: str = "") -> dict:
    up = build_parser().parse_args(["up", *flags])
    return {c.role: serve_config(c.argv[len(CLI) :]) for c in cluster_children(up, token_file)}


def test_the_model_flags_of_vllm_sglang_and_llama_server_name_the_pair():
    for target, draft in (("--model", "--model-draft"), ("--model-path", "-md"), ("-m", "-md")):
        c = _configs(target, "small", draft, "small-draft")
        assert (c["verifier"].model, c["drafter"].model) == ("small", "small-draft")


def test_the_target_may_take_vllm_serves_place_and_is_named_once():
    c = _configs("small", "--http-port", "0")  # `vllm serve MODEL ...`
    assert (c["verifier"].model, c["router"].tokenizer) == ("small", "small")
    assert _configs("small", "--target", "small")["verifier"].model == "small"  # agreeing
    for flags in (("small", "--model", "x"), ("-m", "x", "small")):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["up", *flags])


def test_each_serving_flag_reaches_the_role_that_owns_it():
    c = _configs(
        *("--verifiers", "2", "--port", "9000", "--served-model-name", "coder"),
        *("--max-num-seqs", "4", "--max-model-len", "2048", "--max-num-batched-tokens", "256"),
        *("--enable-auto-tool-choice", "--tool-call-parser", "hermes"),
        *("--reasoning-parser", "qwen3", "--kv-cache-dtype", "fp16", "--dtype", "half"),
        *("--generation-config", "vllm", "--disable-log-stats"),
        *("--chat-template", "{{ messages[0]['content'] }}"),
    )
    router = c["router"]
    assert (router.http_port, router.served_model_name) == (9000, "coder")
    assert (router.tool_call_parser, router.reasoning_parser) == ("hermes", "qwen3")
    assert router.chat_template == "{{ messages[0]['content'] }}"
    assert router.sampling_defaults == "openai"  # vLLM's own defaults, not the model's
    for verifier in (c["verifier"], c["verifier-2"]):
        assert (verifier.engine.max_batch_size, verifier.engine.max_model_len) == (4, 2048)
        assert verifier.log_stats_interval == 0
        assert verifier.engine.max_batched_tokens == 256
    for model in (c["drafter"], c["verifier"]):
        assert (model.dtype, model.kv_dtype) == ("half", "fp16")
    sglang = _configs("--chunked-prefill-size", "64")["verifier"]
    assert sglang.engine.max_batched_tokens == 64
    # llama-server's -n is its n_predict, not a prefix of -np; -1: what the context leaves
    for flags, want in ((("-n", "128"), 128), (("--n-predict", "-1"), -1), ((), 256)):
        llama = _configs(*flags)
        router, verifier = llama["router"], llama["verifier"]
        assert (router.default_max_new_tokens, verifier.engine.max_batch_size) == (want, 16)
    # SGLang's and llama-server's names for the same
    for flags in (
        ("--max-running-requests", "3", "--context-length", "512", "--alias", "x"),
        ("-np", "3", "-c", "512", "-a", "x"),
        ("--parallel", "3", "--ctx-size", "512", "--served-model-name", "x"),
    ):
        c = _configs(*flags)
        assert (c["verifier"].engine.max_batch_size, c["verifier"].engine.max_model_len) == (
            3,
            512,
        )
        assert c["router"].served_model_name == "x"
    # none given: each role's own
    c = _configs()
    assert (c["verifier"].engine.max_batch_size, c["verifier"].engine.max_model_len) == (16, 0)
    assert (c["router"].served_model_name, c["router"].auth_token_file) == ("", "")
    assert (c["router"].sampling_defaults, c["verifier"].log_stats_interval) == ("model", 10.0)
    assert _configs("--generation-config", "auto")["router"].sampling_defaults == "model"


def test_the_api_key_reaches_the_router_in_a_file_only_its_user_reads():
    with _token_file("s3cret") as path:
        assert open(path).read() == "s3cret"
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert _configs("--api-key", "s3cret", token_file=path)["router"].auth_token_file == path
        up = build_parser().parse_args(["up", "--api-key", "s3cret"])
        assert "s3cret" not in " ".join(" ".join(c.argv) for c in cluster_children(up, path))
    assert not os.path.exists(path) and not os.path.exists(os.path.dirname(path))
    with _token_file("") as path:
        assert path == ""


def test_the_api_key_may_come_from_the_environment_and_the_flag_wins(monkeypatch):
    parse = build_parser().parse_args
    monkeypatch.delenv("SPECD_API_KEY", raising=False)
    assert api_key(parse(["up"]).api_key) == ""
    monkeypatch.setenv("SPECD_API_KEY", "from-env")
    assert api_key(parse(["up"]).api_key) == "from-env"
    assert api_key(parse(["up", "--api-key", "given"]).api_key) == "given"


def test_a_flag_set_both_ways_is_refused():
    # (not through `main`: where the check fails, that would start the cluster)
    up = build_parser().parse_args(
        ["up", "--max-num-seqs", "4", "--verifier-flags=--max-batch-size 8"]
    )
    with pytest.raises(ValueError, match="--verifier-flags: --max-batch-size is set by specd up"):
        cluster_children(up)
    with pytest.raises(ConfigError, match="max_model_len must be >= 0, got -1"):
        _configs("--max-model-len", "-1")
    with pytest.raises(ConfigError, match="default_max_new_tokens must be >= 1, or -1"):
        _configs("-n", "-2")
    # no abbreviation stands for another flag (--max-model is not --max-model-len)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--max-model", "10"])
