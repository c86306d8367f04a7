"""Client JSON parsed with a depth limit (specd/json_text.py): the limit is counted on the
brackets outside strings, and nothing deeper reaches Python's recursive parser."""

import json

import pytest

from specd.json_text import MAX_DEPTH, loads, too_deep


def nested(depth: int) -> str:
    return "[" * (depth - 1) + '{"a": 1}' + "]" * (depth - 1)


def test_the_limit_is_the_depth_and_brackets_in_strings_do_not_count():
    assert loads(nested(MAX_DEPTH)) is not None
    with pytest.raises(ValueError, match="nested too deeply"):
        loads(nested(MAX_DEPTH + 1))
    # brackets inside strings (an escaped quote does not end one) are text, not nesting
    text = json.dumps({"a": "[" * 500, "b": '\\"' + "{" * 500, "c": [[1]] * 1000})
    assert not too_deep(text) and loads(text)["c"][0] == [1]
    # the string ends where its quote is not escaped: what follows nests
    assert too_deep('["\\\\", ' + "[" * MAX_DEPTH + "]" * (MAX_DEPTH + 1))


def test_text_far_deeper_than_the_interpreter_allows_is_refused_never_recursed():
    """Python's parser would raise RecursionError here (not a ValueError: a client's
    error the doors answer), at the depth where any finalizer run there fails too."""
    with pytest.raises(ValueError, match="nested too deeply"):
        loads("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match="nested too deeply"):
        loads(b"{" + b'"a": [' * 100_000)  # not JSON either: the depth is found first
