"""The serving flags of a vLLM, SGLang or llama-server launch command on `specd up`: each
under its peers' names reaches the role that owns it, and the API key reaches the router
in a file only its user may read."""

from __future__ import annotations

import json
import os
import re
import stat

import pytest

from launcher import llama_env
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
    for flags in (("small", "--model", "x"), ("-m", "x", "small"), ("-m", "default-target", "x")):
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
    assert (router.http_port, router.served_model_name) == (9000, ["coder"])
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
    # llama-server's -s: the router's seed of every unseeded HTTP request instead
    assert (_configs("-s", "7")["router"].default_seed, _configs()["router"].default_seed) == (
        7,
        -1,
    )
    assert _configs("-s", "7")["verifier"].engine.seed == -1
    seeds = ((("--seed", "0"), 0), (("--random-seed", "5"), 5), (("--seed", "-1"), -1), ((), -1))
    for flags, want in seeds:  # -1: none, as llama-server's default
        c = _configs("--verifiers", "2", *flags)
        assert (c["verifier"].engine.seed, c["verifier-2"].engine.seed) == (want, want)
    # llama-server's physical and logical batches: a forward feeds the smaller
    for flags, want in ((("-ub", "1024", "-b", "512"), 512), (("-b", "64"), 64)):
        assert _configs(*flags)["verifier"].engine.max_batched_tokens == want
    assert _configs("--ubatch-size", "96")["verifier"].engine.max_batched_tokens == 96
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
        assert c["router"].served_model_name == ["x"]
    # none given: each role's own
    c = _configs()
    assert (c["verifier"].engine.max_batch_size, c["verifier"].engine.max_model_len) == (16, 0)
    assert (c["router"].served_model_name, c["router"].auth_token_file) == ([], "")
    # vLLM's several names, the first the one answers carry; the target still named after
    named = _configs("--served-model-name", "coder", "gpt-4o", "--target", "tiny")
    assert named["router"].served_model_name == ["coder", "gpt-4o"]
    assert named["verifier"].model == "tiny"
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


def _children(*flags: str) -> dict:
    up = build_parser().parse_args(["up", *flags])
    return {c.role: c for c in cluster_children(up)}


def test_devices_threads_and_caches_under_the_peers_names():
    c = _configs("-ngl", "0", "--data-parallel-size", "2", "--enable-prefix-caching", "-tp", "1")
    assert [c[r].device for r in ("verifier", "verifier-2", "drafter")] == ["cpu", "cpu", ""]
    assert [c[r].engine.prefix_cache for r in ("verifier", "verifier-2")] == ["on", "on"]
    assert c["drafter"].prefix_cache == "on"
    c = _configs("--gpu-layers-draft", "0", "-ngl", "99", "--no-enable-prefix-caching")
    assert (c["verifier"].device, c["drafter"].device) == ("", "cpu")  # 99: the default
    assert (c["verifier"].engine.prefix_cache, c["drafter"].prefix_cache) == ("off", "off")
    c = _configs("--disable-radix-cache", "--dp-size", "3", "-ngl", "all")  # SGLang's
    assert c["drafter"].prefix_cache == "off" and "verifier-3" in c
    assert (c["verifier"].engine.prefix_cache, c["verifier"].device) == ("off", "")
    c = _configs()
    assert (c["verifier"].engine.prefix_cache, c["verifier"].device) == ("auto", "")
    assert not c["verifier"].engine.enforce_eager and not c["drafter"].enforce_eager
    for flag in ("--gpu-memory-utilization", "--mem-fraction-static"):
        c = _configs(flag, "0.9", "--verifiers", "2")
        assert [c[v].engine.gpu_memory_utilization for v in ("verifier", "verifier-2")] == [
            0.9,
            0.9,
        ]
    for flag in ("--enforce-eager", "--disable-cuda-graph"):  # vLLM's, SGLang's
        c = _configs(flag, "--verifiers", "2")
        assert c["verifier-2"].engine.enforce_eager and c["drafter"].enforce_eager
    # llama-server's -t for both models unless -td names the draft model's
    threads = {r: c.env for r, c in _children("-t", "3").items()}
    assert threads == {
        "drafter": {"OMP_NUM_THREADS": "3"},
        "verifier": {"OMP_NUM_THREADS": "3"},
        "router": {},
    }
    split = _children("--threads", "3", "--threads-draft", "1")
    assert (split["verifier"].env, split["drafter"].env) == (
        {"OMP_NUM_THREADS": "3"},
        {"OMP_NUM_THREADS": "1"},
    )
    assert all(not c.env for c in _children().values())  # each service's own choice


def test_what_specd_cannot_do_is_refused_naming_why(capsys):
    for flags, said in (
        (("--tensor-parallel-size", "2"), "whole on one device"),
        (("--pp-size", "4"), "whole on one device"),
        (("-ngl", "x"), "a count of layers"),
        (("-t", "0"), "a count of threads"),
        (("-mlock",), "unrecognized argument: -mlock"),  # not -m lock
        (("-nkvo",), "unrecognized argument: -nkvo"),  # not -n kvo
    ):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["up", *flags])
        assert said in capsys.readouterr().err
    # a value glued to a short flag is still taken
    assert build_parser().parse_args(["up", "-c4096"]).max_model_len == 4096


def test_flags_that_ask_for_what_specd_does_anyway_change_nothing():
    asked = (
        *("--trust-remote-code", "--jinja", "-cb", "--cont-batching", "--metrics"),
        *("--enable-metrics", "--no-webui", "--disable-log-requests", "-fa", "on"),
        *("--enable-chunked-prefill", "--enable-prompt-tokens-details", "--flash-attn"),
        *("-dt", "0.1", "--cache-reuse", "256"),
        *(
            "--disable-fastapi-docs",
            "--disable-uvicorn-access-log",
            "--enable-server-load-tracking",
        ),
    )
    plain = [c.argv for c in _children().values()]
    assert [c.argv for c in _children(*asked).values()] == plain


def test_llama_servers_sampling_flags_join_vllms_override():
    def overrides(*flags):
        return json.loads(_configs(*flags)["router"].override_generation_config or "{}")

    assert overrides() == {}
    assert overrides("--temp", "0.2", "--top-k", "1", "--top-p", "0.9", "--min-p", "0.1") == {
        "temperature": 0.2,
        "top_k": 1,
        "top_p": 0.9,
        "min_p": 0.1,
    }
    given = '{"repetition_penalty": 1.1}'
    assert overrides("--override-generation-config", given, "--temperature", "0") == {
        "repetition_penalty": 1.1,
        "temperature": 0.0,
    }
    with pytest.raises(ValueError, match="temperature given in --override-generation-config"):
        _configs("--override-generation-config", '{"temperature": 1}', "--temp", "0.5")
    for bad, said in (
        ('{"max_new_tokens": 5}', "'max_new_tokens' is not one of temperature"),
        ('{"top_p": 0}', "top_p = 0 is out of range"),
        ('{"temperature": NaN}', "temperature = nan is out of range"),
        ("[1]", "must be a JSON object"),
        ("{", "is not JSON"),
    ):
        with pytest.raises(ValueError, match=re.escape(said)):
            _configs("--override-generation-config", bad)
    with pytest.raises(ConfigError, match="top_p = 2.0 is out of range"):
        _configs("--top-p", "2")  # said by the router's config, before anything starts


def test_llama_servers_slots_switch_reaches_the_router():
    assert _configs()["router"].slots is True  # on, as llama-server's
    assert _configs("--no-slots")["router"].slots is False


def test_vllms_cors_flags_reach_the_router():
    router = _configs()["router"]
    assert (router.allowed_origins, router.allowed_headers) == ('["*"]', '["*"]')
    assert router.allow_credentials is False
    sites = '["https://chat.example.com"]'
    router = _configs(
        *("--allowed-origins", sites, "--allowed-methods", '["POST"]'),
        *("--allowed-headers", "content-type", "--allow-credentials"),
    )["router"]
    assert (router.allowed_origins, router.allowed_methods) == (sites, '["POST"]')
    assert (router.allowed_headers, router.allow_credentials) == ("content-type", True)
    with pytest.raises(ConfigError, match="allowed_origins"):
        _configs("--allowed-origins", '["https://a.example"')  # refused before anything starts


def test_vllms_and_llama_servers_ssl_flags_make_the_http_port_https(tmp_path):
    from tests.integration.test_tls import self_signed

    cert, key = self_signed(tmp_path)
    for flags in (
        ("--ssl-certfile", cert, "--ssl-keyfile", key),
        ("--ssl-cert-file", cert, "--ssl-key-file", key),
    ):
        router = _configs(*flags)["router"]
        assert (router.http_tls_cert, router.http_tls_key) == (cert, key)
        assert (router.tls_cert, router.tls_key) == ("", "")  # the gRPC port stays plain
    with pytest.raises(ConfigError, match="http_tls_cert and http_tls_key: give both"):
        _configs("--ssl-certfile", cert)


def test_a_vllm_config_file_is_read_as_its_flags_and_the_command_line_wins(tmp_path, capsys):
    config = tmp_path / "vllm.yaml"
    config.write_text(
        "model: tiny-from-file\n"
        "max_num_seqs: 8\n"  # vLLM takes underscores too
        "max-model-len: 4096\n"
        "served-model-name: [coder, gpt-4o]\n"  # a flag of several values
        "allowed-origins: [https://a.example]\n"  # one of JSON text
        "speculative-config: {method: ngram, num_speculative_tokens: 4}\n"
        "enable-prefix-caching: false\n"  # its --no- form
        "disable-log-stats: true\n"
        "trust-remote-code: false\n"  # a switch left off
        "seed: 0\n"
    )
    c = _configs("--config", str(config))
    verifier, router = c["verifier"], c["router"]
    assert (verifier.model, verifier.engine.max_batch_size) == ("tiny-from-file", 8)
    assert (verifier.engine.max_model_len, verifier.engine.seed) == (4096, 0)
    assert (verifier.engine.prefix_cache, verifier.log_stats_interval) == ("off", 0)
    assert router.served_model_name == ["coder", "gpt-4o"]
    assert json.loads(router.allowed_origins) == ["https://a.example"]
    assert verifier.lookup and "drafter" not in c  # the file's speculative-config: ngram
    assert json.loads(router.policy)["default"]["num_draft_tokens"] == 4
    # the command line's flags and model win over the file's
    c = _configs("tiny-on-the-line", "--config", str(config), "--max-num-seqs", "2")
    assert (c["verifier"].model, c["verifier"].engine.max_batch_size) == ("tiny-on-the-line", 2)
    for text, said in (
        ("no-such-flag: 1\n", "no-such-flag is none of the flags it takes"),
        ("- max-num-seqs\n", "a mapping of flags to values"),
        ("a: [b\n", "not YAML"),
    ):
        config.write_text(text)
        with pytest.raises(SystemExit):
            _configs("--config", str(config))
        assert said in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _configs("--config", str(tmp_path / "none.yaml"))
    assert "No such file" in capsys.readouterr().err


def test_sglangs_and_vllms_log_levels_reach_every_service(monkeypatch):
    def levels(*words: str) -> set[str]:
        up = build_parser().parse_args([*words, "up"] if words[:1] == ("-v",) else ["up", *words])
        argvs = [c.argv for c in cluster_children(up)]
        return {argv[argv.index("--log-level") + 1] for argv in argvs}

    assert levels() == {"info"}
    assert levels("--log-level", "warning") == {"warning"}  # SGLang's
    assert levels("--uvicorn-log-level", "trace") == {"debug"}  # vLLM's
    assert levels("-v") == {"debug"}  # specd's own, for its services too
    # and `specd --log-level` sets what a process logs
    import logging

    from launcher.cli import main

    said = {}
    monkeypatch.setattr(logging, "basicConfig", lambda **kw: said.update(kw))
    main(["--log-level", "warning", "health", "127.0.0.1:1", "--timeout", "0.1"])
    assert said["level"] == logging.WARNING


def test_llama_servers_environment_is_read_as_its_flags_and_the_command_line_wins(
    monkeypatch, capsys
):
    """A llama.cpp container's `LLAMA_ARG_*` variables start specd as llama-server."""
    for name in [n for n in os.environ if n.startswith("LLAMA_")]:
        monkeypatch.delenv(name)
    environment = {
        "LLAMA_ARG_MODEL": "small",
        "LLAMA_ARG_MODEL_DRAFT": "small-draft",
        "LLAMA_ARG_HOST": "0.0.0.0",
        "LLAMA_ARG_PORT": "8123",
        "LLAMA_ARG_ALIAS": "coder",
        "LLAMA_ARG_CTX_SIZE": "4096",
        "LLAMA_ARG_N_PARALLEL": "3",
        "LLAMA_ARG_SPEC_DRAFT_N_MAX": "6",
        "LLAMA_ARG_TEMPERATURE": "0.2",
        "LLAMA_ARG_JINJA": "true",
        "LLAMA_ARG_ENDPOINT_METRICS": "0",
        "LLAMA_ARG_ENDPOINT_SLOTS": "disabled",
        "LLAMA_ARG_FLASH_ATTN": "1",
        "LLAMA_ARG_NO_WEBUI": "1",
        "LLAMA_API_KEY": "from-llama-env",
    }
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    up = build_parser().parse_args(["up"])
    assert (up.api_key, up.host, up.flash_attn, up.jinja, up.metrics) == (
        "from-llama-env", "0.0.0.0", "on", True, False,
    )  # fmt: skip
    c = _configs()
    verifier, router, drafter = c["verifier"], c["router"], c["drafter"]
    assert (verifier.model, drafter.model, verifier.host) == ("small", "small-draft", "0.0.0.0")
    assert (verifier.engine.max_model_len, verifier.engine.max_batch_size) == (4096, 3)
    assert (router.http_port, router.served_model_name, router.slots) == (8123, ["coder"], False)
    assert json.loads(router.override_generation_config) == {"temperature": 0.2}
    assert json.loads(router.policy)["default"]["num_draft_tokens"] == 6
    # the command line wins, the target included (not a second name)
    c = _configs("-m", "tiny", "-c", "2048", "--port", "8124", "--slots")
    assert (c["verifier"].model, c["verifier"].engine.max_model_len) == ("tiny", 2048)
    assert (c["router"].http_port, c["router"].slots) == (8124, True)
    # a variable for a flag specd up does not take, or a switch neither true nor false
    for name, value, said in (
        ("LLAMA_ARG_MLOCK", "1", "LLAMA_ARG_MLOCK (llama-server's environment) names a flag"),
        ("LLAMA_ARG_JINJA", "maybe", "LLAMA_ARG_JINJA=maybe: a switch is one of on"),
    ):
        monkeypatch.setenv(name, value)
        with pytest.raises(SystemExit):
            build_parser().parse_args(["up"])
        assert said in capsys.readouterr().err
        monkeypatch.setenv("LLAMA_ARG_JINJA", "on")
        monkeypatch.delenv("LLAMA_ARG_MLOCK", raising=False)
    # every variable stands for a flag specd up takes
    up_parser = build_parser()._subparsers._group_actions[0].choices["up"]
    flags = [*llama_env.VALUES.values(), *llama_env.SWITCHES.values(), "--flash-attn"]
    flags += [f"--{no}{name}" for name in llama_env.TOGGLES.values() for no in ("", "no-")]
    assert all(flag in up_parser._option_string_actions for flag in flags)
