"""What a constrained request asks for, checked once (torch-free: the router validates it).

A constraint is compiled by llguidance (https://github.com/guidance-ai/llguidance) into
one grammar text: JSON schemas, "any JSON object" and regular expressions become grammars
of its Lark dialect. llguidance was chosen over xgrammar and outlines-core by measurement
(docs/benchmarks-log.md, "Structured output"): it compiles a schema in ~4 ms where xgrammar took
~50 ms and outlines-core's vocabulary index ~1.6 s, computes a mask in ~17 us (all three
are far below a decode step), takes Lark grammars as well as schemas and regexes, rolls
back, and has no dependencies (xgrammar's wheel requires triton).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

KINDS = ("json_schema", "json_object", "regex", "grammar")


@dataclass(frozen=True)
class Constraint:
    kind: str  # one of KINDS
    text: str = ""  # the schema (JSON text), regex or grammar; "" for json_object

    def grammar(self) -> str:
        """The llguidance grammar, compiled once per distinct constraint; ValueError with
        the library's message when the constraint is not valid."""
        return compile_grammar(self.kind, self.text)


def named(
    json_schema: dict | str | None = None,
    json_object: bool = False,
    regex: str | None = None,
    grammar: str | None = None,
) -> Constraint | None:
    """The one constraint given by keyword (a schema may be a dict); None for none,
    ValueError for more than one."""
    if isinstance(json_schema, dict):
        json_schema = json.dumps(json_schema)
    given = {"json_schema": json_schema, "regex": regex, "grammar": grammar}
    given = {kind: text for kind, text in given.items() if text is not None}
    if json_object:
        given["json_object"] = ""
    if len(given) > 1:
        raise ValueError(f"at most one constraint per request, got {sorted(given)}")
    return Constraint(*next(iter(given.items()))) if given else None


def choice_grammar(options: list[str]) -> str:
    """A grammar (llguidance's Lark) whose language is exactly `options`: vLLM's
    `guided_choice`. Its string literals are JSON's, which Lark reads alike."""
    if not options:
        raise ValueError("a choice needs at least one option")
    return "start: " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options)


@functools.lru_cache(maxsize=256)
def compile_grammar(kind: str, text: str) -> str:
    from llguidance import LLMatcher

    if kind == "json_object":
        grammar = LLMatcher.grammar_from_json_schema({"type": "object"})
    elif kind == "json_schema":
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"json_schema is not valid JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise ValueError("json_schema must be a JSON object (a schema)")
        grammar = LLMatcher.grammar_from_json_schema(schema)
    elif kind == "regex":
        grammar = LLMatcher.grammar_from_regex(text)
    elif kind == "grammar":
        grammar = LLMatcher.grammar_from_lark(text)
    else:
        raise ValueError(f"unknown constraint kind {kind!r}; expected one of {KINDS}")
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"invalid {kind}: {error.strip()}")
    return grammar
