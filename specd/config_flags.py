"""The services' flags, derived from their configs (`specd.config`'s dataclasses) so that
each default and its help live in one place: a flag per field, its help the field's
comment, and the config built back from the parsed flags."""

from __future__ import annotations

import argparse
import inspect
import re
import typing
from dataclasses import MISSING, fields, is_dataclass

from specd.config import ConfigError


def field_docs(cls) -> dict[str, str]:
    """Each field's comment in the class's source, as one line: the one after it on its
    line, else the comment lines right above it (a `# --` section heading, and a comment
    set apart by a blank line, are not a field's). The flags' help is made of them, as
    vLLM makes its help of its configs' docstrings."""
    docs, above = {}, []
    for line in inspect.getsource(cls).splitlines()[1:]:
        text = line.strip()
        if not text or text.startswith("# --"):
            above = []
        elif text.startswith("#"):
            above.append(text.lstrip("#").strip())
        elif (match := re.match(r"    (\w+): ", line)) is not None:
            after = line.split("  # ", 1)[1].strip() if "  # " in line else ""
            docs[match.group(1)] = after or " ".join(above)
            above = []
        else:
            above = []
    return docs


def flag_docs(cls) -> dict[str, str]:
    """`field_docs` as the flags' help says them: a field of `cls` named in another's
    comment (`tls_key`, or `model` in backquotes) is named as its flag (--tls-key)."""
    names = [f.name for f in fields(cls)]
    joined, plain = "|".join(names), "|".join(n for n in names if "_" in n)
    named = re.compile(rf"`({joined})`|\b({plain})\b")
    return {
        name: named.sub(lambda m: "--" + (m.group(1) or m.group(2)).replace("_", "-"), doc)
        for name, doc in field_docs(cls).items()
    }


def add_arguments(parser, cls, prefix: str = "", into=None) -> None:
    """One flag per field (into the group `into` where given); a nested dataclass's in a
    group of its own, headed by its docstring."""
    hints, docs = typing.get_type_hints(cls), flag_docs(cls)
    into = parser if into is None else into
    for f in fields(cls):
        kind = hints[f.name]
        if is_dataclass(kind):
            group = parser.add_argument_group(f.name, (kind.__doc__ or "").strip())
            add_arguments(parser, kind, f"{prefix}{f.name}.", group)
            continue
        flag = "--" + f.name.replace("_", "-")
        dest = prefix + f.name
        default = f.default if f.default is not MISSING else None
        said = docs.get(f.name, "").replace("%", "%%")  # argparse formats help with %
        if kind is bool:
            into.add_argument(
                flag, dest=dest, action=argparse.BooleanOptionalAction, default=default,
                help=said or None,
            )  # fmt: skip
        elif typing.get_origin(kind) is list:
            help_ = f"{said} (repeat for several)" if said else "repeat for several"
            into.add_argument(flag, dest=dest, action="append", default=None, help=help_)
        else:
            shown = f"{said} (default: {default!r})" if said else f"default: {default!r}"
            metavar = kind.__name__.upper()
            into.add_argument(
                flag, dest=dest, type=kind, default=default, help=shown, metavar=metavar
            )


def from_arguments(cls, namespace, prefix: str = ""):
    """The config `cls` of parsed flags; ConfigError where a value is refused."""
    hints = typing.get_type_hints(cls)
    values = {}
    for f in fields(cls):
        if is_dataclass(hints[f.name]):
            values[f.name] = from_arguments(hints[f.name], namespace, f"{prefix}{f.name}.")
            continue
        value = getattr(namespace, prefix + f.name, None)
        if value is not None:
            values[f.name] = value
    try:
        return cls(**values)
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
