"""JSON text from a client, parsed with a depth limit: `loads`, and `too_deep` to check
raw bytes first. Python's parser recurses once a level, up to the interpreter's limit,
where it raises RecursionError, and where even a finalizer the garbage collector happens
to run fails; no text deeper than MAX_DEPTH reaches it."""

from __future__ import annotations

import json
import re
from itertools import accumulate
from typing import Any

# serde_json's limit: deeper than any request or JSON schema a client writes
MAX_DEPTH = 128
TOO_DEEP = f"nested too deeply (more than {MAX_DEPTH} levels)"
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


def too_deep(raw: bytes | str) -> bool:
    """Whether the text's brackets nest deeper than MAX_DEPTH, counted outside its
    strings, without recursion."""
    if isinstance(raw, str):
        raw = raw.encode(errors="surrogatepass")
    if raw.count(b"[") + raw.count(b"{") <= MAX_DEPTH:
        return False
    brackets = _STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    return max(accumulate(_STEP[b] for b in brackets), default=0) > MAX_DEPTH


def loads(text: bytes | str, **kwargs) -> Any:
    """json.loads, with ValueError for text nested deeper than MAX_DEPTH."""
    if too_deep(text):
        raise ValueError(TOO_DEEP)
    return json.loads(text, **kwargs)


def loads_object(text: bytes | str, name: str) -> dict:
    """A JSON object given as text (a flag's value, a request's field), or ValueError
    naming it (`name`) and saying what is wrong."""
    try:
        data = loads(text)
    except ValueError as exc:
        raise ValueError(f"{name} is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{name} must be a JSON object")
    return data
