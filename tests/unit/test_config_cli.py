"""`specd serve ROLE` flags are derived from the config dataclasses: every field is a flag,
its default is the dataclass's, nested configs flatten, and the values come back typed."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import re

import pytest
import torch

from launcher.cli import main
from launcher.cli_parser import BENCHES, ROLES, build_parser, serve_config
from launcher.local_cluster import CLI, cluster_children
from specd.config import DTYPES, ConfigError, EngineConfig, RouterConfig
from specd.config_flags import from_arguments
from specd.models.args import parse_dtype
from specd.models.paged_kv import kv_dtype


def _config(role: str, *flags: str):
    args = build_parser().parse_args(["serve", role, *flags])
    return from_arguments(ROLES[role], args)


@pytest.mark.parametrize("role", sorted(ROLES))
def test_no_flags_give_the_dataclass_defaults(role):
    assert _config(role) == ROLES[role]()


def test_flags_set_typed_values_in_nested_configs():
    config = _config(
        "verifier",
        "--port=7001",
        "--drain-seconds=2.5",
        "--max-draft-tokens=3",
        "--no-batch-invariant",
        "--weights=int8",
    )
    assert config.port == 7001 and config.drain_seconds == 2.5 and config.weights == "int8"
    engine = config.engine
    assert engine.max_draft_tokens == 3 and engine.batch_invariant is False
    assert dataclasses.replace(engine, max_draft_tokens=8, batch_invariant=True) == EngineConfig()


def test_list_fields_repeat():
    config = _config("router", "--verifier=a:1", "--verifier=b:2")
    assert config.verifier == ["a:1", "b:2"] and config.verifier_dns == []
    assert isinstance(config, RouterConfig)


def test_invalid_values_are_refused_by_the_dataclass():
    with pytest.raises(ValueError, match="weights"):
        _config("verifier", "--weights=int3")
    for role in ("verifier", "drafter"):
        assert _config(role, "--kv-dtype=fp32").kv_dtype == "fp32"
        with pytest.raises(ValueError, match="kv_dtype must be one of auto, fp32, fp16, bf16"):
            _config(role, "--kv-dtype=int8")
    with pytest.raises(ValueError, match="max_batched_tokens"):
        _config("verifier", "--max-batched-tokens=4", "--max-draft-tokens=8")
    with pytest.raises(SystemExit):  # argparse: not an int
        _config("verifier", "--port=many")
    for role in ("verifier", "drafter"):
        with pytest.raises(ValueError, match="dtype must be one of auto, bf16, fp32, fp16"):
            _config(role, "--dtype=fp64")
    device = torch.device("cpu")  # every spelling the config takes is one the loader parses
    assert {parse_dtype(name, device) for name in DTYPES} >= {torch.float32, torch.float16}
    # vLLM's --dtype spellings
    assert (parse_dtype("half", device), parse_dtype("float", device)) == (
        torch.float16,
        torch.float32,
    )
    assert _config("verifier", "--dtype=half").dtype == "half"
    # the verifier drafts by its own lookup or asks a drafter, never both
    with pytest.raises(ValueError, match="give one"):
        _config("verifier", "--lookup", "--drafter=127.0.0.1:1")
    for role in ("verifier", "drafter"):
        with pytest.raises(ValueError, match="1 <= min <= max, got 3 and 2"):
            _config(role, "--prompt-lookup-min=3", "--prompt-lookup-max=2")


def test_a_refused_value_is_one_line_before_anything_starts(capsys):
    assert main(["serve", "verifier", "--weights", "int3"]) == 2
    said = capsys.readouterr().err
    assert (
        said == "specd serve verifier: weights must be one of auto, bf16, int8, int4, got 'int3'\n"
    )
    assert main(["up", "--draft-p-min", "2", "--http-port", "0"]) == 2
    assert capsys.readouterr().err == "specd up: drafter: p_min must be in [0, 1], got 2.0\n"
    assert main(["up", "--dtype", "fp64", "--verifiers", "2"]) == 2
    assert "specd up: drafter: dtype must be one of" in capsys.readouterr().err


def test_specd_up_passes_each_role_its_own_flags(capsys):
    """`--verifier-flags` reaches every verifier, and a value or flag the role refuses, or
    one `up` sets itself (a port it would wait on), is said before anything starts."""
    up = build_parser().parse_args(
        ["up", "--verifiers", "2", "--verifier-flags=--horizon 16 --device cpu",
         "--router-flags=--metrics-port 9090"]
    )  # fmt: skip
    children = {c.role: c.argv for c in cluster_children(up)}
    for role in ("verifier", "verifier-2"):
        assert children[role][-4:] == ["--horizon", "16", "--device", "cpu"]
        assert serve_config(children[role][len(CLI) :]).engine.speculation.horizon == 16
    assert children["router"][-2:] == ["--metrics-port", "9090"]
    assert "--horizon" not in children["drafter"]
    for taken in ("--port 50070", "--port=50070", "--drafter 127.0.0.1:1"):
        assert main(["up", f"--verifier-flags={taken}", "--http-port", "0"]) == 2
        said = capsys.readouterr().err
        assert said.startswith(f"specd up: --verifier-flags: {taken.split()[0]} is set by")
    assert main(["up", "--verifier-flags=--explore-window 2", "--http-port", "0"]) == 2
    said = capsys.readouterr().err
    assert said == "specd up: verifier: explore_window must be in [0, 1], got 2.0\n"
    assert main(["up", "--drafter-flags=--horizon 16", "--http-port", "0"]) == 2
    said = capsys.readouterr().err
    assert said.endswith("--horizon 16\nspecd up: drafter: see `specd serve drafter --help`\n")
    assert "unrecognized arguments" in said
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--router-flags='--http-port 0"])
    assert "No closing quotation" in capsys.readouterr().err


def test_the_kv_cache_dtype_follows_the_activations_unless_they_are_fp32():
    f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
    assert kv_dtype("auto", f32) == f16  # half the bytes where there is no bf16 hardware
    assert kv_dtype("auto", bf16) == bf16 and kv_dtype("auto", f16) == f16
    assert kv_dtype("fp32", f32) == f32 and kv_dtype("bf16", f32) == bf16
    with pytest.raises(ValueError, match="a fp16 KV cache needs fp32 activations or fp16 ones"):
        kv_dtype("fp16", bf16)  # no kernel reads fp16 keys under bf16 queries


def _flags(cls):
    """One flag per leaf field, each spelling its default value."""
    for f in dataclasses.fields(cls):
        value = getattr(cls(), f.name)
        if dataclasses.is_dataclass(value):
            yield from _flags(type(value))
        elif isinstance(value, bool):
            yield ("--" if value else "--no-") + f.name.replace("_", "-")
        elif not isinstance(value, list):
            yield f"--{f.name.replace('_', '-')}={value}"


@pytest.mark.parametrize("role", sorted(ROLES))
def test_every_field_has_a_flag(role):
    flags = list(_flags(ROLES[role]))
    assert len(flags) > 10
    assert _config(role, *flags) == ROLES[role]()  # argparse refuses an unknown flag


def _helps(parser):
    """Every option of `specd serve ROLE`'s parser with its help text."""
    return {
        a.option_strings[0]: a.help or ""
        for a in parser._actions
        if a.option_strings and a.option_strings[0] != "-h"
    }


@pytest.mark.parametrize("role", sorted(ROLES))
def test_every_flag_says_what_it_does(role):
    """The help of each flag is its field's comment in the config's source (plus its
    default), so the two cannot drift; a field without one would print a bare default."""
    parser = build_parser()._subparsers._group_actions[0].choices["serve"]
    role_parser = parser._subparsers._group_actions[0].choices[role]
    flags = _helps(role_parser)
    assert flags, role
    bare = [flag for flag, text in flags.items() if not text or text.startswith("default:")]
    assert bare == []
    # each flag says what it alone does: no two share one text, and a flag named in
    # another's text is named as the user types it (--tls-key, not tls_key)
    texts = {}
    for flag, text in flags.items():
        texts.setdefault(text.rsplit(" (default:", 1)[0], []).append(flag)
    assert [same for same in texts.values() if len(same) > 1] == []
    fields = {flag[2:].replace("-", "_") for flag in flags}
    named = {
        f: [w for w in re.findall(r"[a-z]+_[a-z_]+", t) if w in fields] for f, t in flags.items()
    }
    assert {f: words for f, words in named.items() if words} == {}
    if role == "verifier":  # the speculation control's tuned numbers are flags too
        said = flags["--horizon"]
        assert "steps a switch's cost" in said and "32" in said
        assert _config(role, "--horizon=8").engine.speculation.horizon == 8
        assert "room for the model's whole context" in flags["--kv-cache-bytes"]
        assert "with --tls-key," in flags["--tls-cert"]


def _unsaid(parser) -> list[str]:
    """The flags of `parser` whose help is missing, or that take a value and do not say
    what it is when not given."""
    out = []
    for a in parser._actions:
        if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        valued = a.option_strings and a.nargs is None and a.default not in (None, "")
        said = a.help and (not valued or "%(default)" in a.help or str(a.default) in a.help)
        if not said:
            out.append(a.dest)
    return out


def test_every_launcher_command_says_what_each_flag_does():
    """`specd up`, `generate`, `health`, `models fetch` and `bench`: no bare flag, and a
    flag that takes a value says what it is when not given."""

    def parsers(parser, path=()):
        yield path, parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    yield from parsers(child, path + (name,))

    commands = {
        " ".join(path): parser
        for path, parser in parsers(build_parser())
        if path[:1] != ("serve",)  # the roles' flags: test_every_flag_says_what_it_does
    }
    assert {"up", "generate", "models fetch", "bench"} <= set(commands)
    assert {path: _unsaid(p) for path, p in commands.items() if _unsaid(p)} == {}


def test_every_bench_says_what_each_flag_does(monkeypatch):
    """`specd bench KIND -h` for every KIND, its parser as its main() builds it."""

    class Built(Exception):
        pass

    def built(parser, *args, **kwargs):
        raise Built(parser)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", built)
    unsaid = {}
    for kind, module in BENCHES.items():
        with pytest.raises(Built) as parser:
            importlib.import_module(module).main([])
        unsaid[kind] = _unsaid(parser.value.args[0])
    assert {kind: flags for kind, flags in unsaid.items() if flags} == {}


@pytest.mark.parametrize(
    "name,fetched",
    [
        ("default", ["qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"]),
        ("small", ["smollm2-135m-instruct"]),
        ("default-target", ["qwen2.5-coder-1.5b-instruct"]),
        ("default-draft", ["qwen2.5-coder-0.5b-instruct"]),
        ("qwen2.5-coder-0.5b-instruct", ["qwen2.5-coder-0.5b-instruct"]),
    ],
)
def test_models_fetch_takes_a_set_or_one_of_its_models(monkeypatch, tmp_path, name, fetched):
    import launcher.cli
    import specd.models.fetch

    asked = []
    monkeypatch.setattr(specd.models.fetch, "fetch_model", lambda n: asked.append(n) or tmp_path)
    monkeypatch.setattr(launcher.cli, "_keep_freed_memory", lambda: None)  # a test process
    assert launcher.cli._models(build_parser().parse_args(["models", "fetch", name])) == 0
    assert asked == fetched


def test_models_fetch_refuses_a_name_it_does_not_know(capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["models", "fetch", "llama-7b"])
    assert exc.value.code == 2 and "invalid choice: 'llama-7b'" in capsys.readouterr().err


def test_specd_up_refuses_ports_another_server_holds(capsys):
    """Its children's health checks would be answered by the other server's: `up` would
    take it for its own and restart its children forever."""
    import socket

    from launcher.local_cluster import in_use
    from launcher.processes import free_port

    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        held = other.getsockname()[1]
        free = free_port()
        assert in_use("127.0.0.1", held) and not in_use("127.0.0.1", free)
        flags = ["--router-port", str(free), "--verifier-port", str(free_port())]
        assert main(["up", *flags, "--drafter-port", str(held), "--http-port", "0"]) == 2
    assert capsys.readouterr().err.startswith(f"specd up: 127.0.0.1:{held} (drafter) is in use")


def test_a_listeners_certificate_and_key_are_checked_before_it_starts(tmp_path):
    """Both or neither, readable, a PEM certificate with its own key: said in one line,
    for each role, rather than a traceback when the listener starts."""
    from tests.integration.test_tls import self_signed

    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    cert, key = self_signed(tmp_path / "a")
    _, other_key = self_signed(tmp_path / "b")
    for role in ("drafter", "verifier", "router"):
        assert serve_config(["serve", role, "--tls-cert", cert, "--tls-key", key]).tls_cert == cert
        for flags, said in (
            (["--tls-cert", cert], "give both, or neither"),
            (["--tls-cert", cert, "--tls-key", other_key], "(key values mismatch)"),
            (["--tls-cert", str(tmp_path / "none.pem"), "--tls-key", key], "No such file"),
            (["--tls-cert", key, "--tls-key", key], "not a PEM certificate and its key"),
        ):
            with pytest.raises(ConfigError, match=re.escape(said)):
                serve_config(["serve", role, *flags])
