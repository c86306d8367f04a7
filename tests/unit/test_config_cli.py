"""`specd serve ROLE` flags are derived from the config dataclasses: every field is a flag,
its default is the dataclass's, nested configs flatten, and the values come back typed."""

from __future__ import annotations

import dataclasses

import pytest

from specd.cli_parser import ROLES, build_parser
from specd.config import EngineConfig, RouterConfig, from_arguments


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
    with pytest.raises(ValueError, match="max_batched_tokens"):
        _config("verifier", "--max-batched-tokens=4", "--max-draft-tokens=8")
    with pytest.raises(SystemExit):  # argparse: not an int
        _config("verifier", "--port=many")


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
