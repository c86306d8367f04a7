"""vLLM's `--config FILE` on `specd up`: a YAML file of launch flags, `key: value` for
`--key value`, read as if given before the command line's (whose flags win where both
name one), so that a vLLM server's config file starts specd as it is."""

from __future__ import annotations

import argparse
import json

import yaml

CONFIG_FLAG = "--config"
# the hidden flag a file's `model` becomes: the target where the command line names none
CONFIG_TARGET = "--config-target"


class ConfigTarget(argparse.Action):
    """The file's target, not counted as named: the command line's (a `Target`, read after
    it) takes its place rather than being refused as a second name."""

    def __call__(self, parser, namespace, value, option_string=None):
        namespace.target = value


def expand(words: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """`words` with each `--config FILE` (or `--config=FILE`) replaced by the file's flags,
    placed first. A key names a flag of `parser` (dashes or underscores); true sets a
    switch, false sets its `--no-` form where it has one (else leaves it off), a list
    gives a flag that takes several values each one (any other, the list as JSON), a
    mapping is JSON text (`speculative-config: {method: ngram}`), null is skipped."""
    rest, files, i = [], [], 0
    while i < len(words):
        word = words[i]
        if word == CONFIG_FLAG and i + 1 < len(words):
            files.append(words[i + 1])
            i += 2
            continue
        if word.startswith(CONFIG_FLAG + "="):
            files.append(word.split("=", 1)[1])
        else:
            rest.append(word)
        i += 1
    given = [flag for path in files for flag in _flags(path, _read(path, parser), parser)]
    return given + rest


def _read(path: str, parser) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        parser.error(f"--config {path}: {exc.strerror}")
    except yaml.YAMLError as exc:
        parser.error(f"--config {path}: not YAML ({exc})")
    if data is None:
        return {}
    if not isinstance(data, dict):
        parser.error(f"--config {path}: a mapping of flags to values (key: value), not a list")
    return data


def _flags(path: str, data: dict, parser) -> list[str]:
    known = parser._option_string_actions
    out = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        if flag not in known or flag in (CONFIG_FLAG, CONFIG_TARGET):
            parser.error(f"--config {path}: {key} is none of the flags it takes (see -h)")
        if flag in ("--model", "--target", "--model-path") and isinstance(value, str):
            out += [CONFIG_TARGET, value]
        elif isinstance(value, bool):
            negated = "--no-" + flag[2:]
            out += [flag] if value else [negated] if negated in known else []
        elif isinstance(value, list):
            if known[flag].nargs in ("+", "*"):
                out += [flag, *map(str, value)] if value else []
            else:
                out += [flag, json.dumps(value)]
        elif isinstance(value, dict):
            out += [flag, json.dumps(value)]
        elif value is not None:
            out += [flag, str(value)]
    return out
