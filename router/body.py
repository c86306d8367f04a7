"""What every HTTP door's request bodies share: strict models (unknown fields refused),
`parse` from raw bytes with a message naming the field at fault, and `BodyError` (a 400).
Torch-free and server-free."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from specd import json_text


class BodyError(ValueError):
    """A body that cannot be served: 400 with `param` naming the field (None: the body)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class Request(Strict):
    """A request body `parse` reads."""

    def unsupported(self) -> dict[str, bool]:
        """Field -> whether it asks for something specd does not do (BodyError where
        fields contradict each other)."""
        return {}


def parse(raw: bytes, kind: type[Request]) -> Request:
    """The body as `kind`, or BodyError with a message naming the field."""
    if json_text.too_deep(raw):
        raise BodyError(f"the body is {json_text.TOO_DEEP}")
    try:
        data = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BodyError(f"the body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise BodyError("the body must be a JSON object")
    where = _not_unicode(data)
    if where is not None:
        raise BodyError(f"{where}: a lone UTF-16 surrogate (\\ud800-\\udfff) is not text", where)
    try:
        body = kind.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        path = _in_body(data, err["loc"], missing=err["type"] == "missing")
        where = ".".join(str(p) for p in path) or None
        if err["type"] == "extra_forbidden":
            raise BodyError(f"unknown field {where!r}", where) from None
        raise BodyError(f"{where}: {err['msg']}", where) from None
    for field, refused in body.unsupported().items():
        if refused:
            raise BodyError(f"{field!r} is not supported by specd", field)
    return body


def has_field(raw: bytes, name: str) -> bool:
    """Whether the body is a JSON object with this field (False where it is no JSON: its
    parse says why)."""
    try:
        data = json_text.loads(raw)
    except ValueError:
        return False
    return isinstance(data, dict) and name in data


def _in_body(data, loc: tuple, missing: bool = False) -> list:
    """An error's location as a path in the body: pydantic's, less the names it gives
    the members of a union (`tool_choice.literal[...]` is `tool_choice`); `missing`: the
    error is a required field's absence (its name ends the path)."""
    path = []
    for i, part in enumerate(loc):
        if isinstance(data, list) and isinstance(part, int) and part < len(data):
            path.append(part)
            data = data[part]
        elif isinstance(data, dict) and part in data:
            path.append(part)
            data = data[part]
        elif isinstance(data, dict) and i == len(loc) - 1 and missing:
            path.append(part)  # a field it lacks
        elif not isinstance(data, (dict, list)):
            break  # a value's union member names
        # else the name of the union member the list or object was read as
    return path


def _not_unicode(data: dict) -> str | None:
    """Where the body holds a string UTF-8 cannot encode (a lone surrogate, which JSON's
    `\\u` escapes can spell), as a field path; None if nowhere. Iterative: a body may nest
    as deep as the JSON parser allows."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                where = f"{path}.{key}" if path else key
                stack.append((where, key))
                stack.append((where, item))
        elif isinstance(value, list):
            nested = (str, list, dict)  # a list of token ids holds none
            stack.extend((f"{path}.{i}", x) for i, x in enumerate(value) if isinstance(x, nested))
        elif isinstance(value, str):
            try:
                value.encode()
            except UnicodeEncodeError:
                return path
    return None


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")
