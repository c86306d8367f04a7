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

from specd import json_text

KINDS = ("json_schema", "json_object", "regex", "grammar")
# A reasoning model's thinking as each reasoning parser reads it (router/reasoning.py), in
# llguidance's Lark: text without "</think>" (`_FREE`), "</think>" and the newlines after
# it (the reader drops them), then the answer the constraint holds. An output still
# thinking may also end there (THINKING), as it may without a constraint.
_FREE = r"/(.|\n)*/ & ~/(.|\n)*<\/think>(.|\n)*/"
THINKING = {
    # the template opened <think>: the output thinks from its start
    "deepseek_r1": rf"""start: THINKING | THOUGHT @answer
THINKING: {_FREE}
THOUGHT: ({_FREE}) "</think>" /\n*/""",
    # the output thinks only where it opens with <think> (whitespace aside)
    "qwen3": rf"""start: THINKING | THOUGHT? @answer
THINKING: /\s*<think>/ ({_FREE})
THOUGHT: /\s*<think>/ ({_FREE}) "</think>" /\n*/""",
}


@dataclass(frozen=True)
class Constraint:
    kind: str  # one of KINDS
    text: str = ""  # the schema (JSON text), regex or grammar; "" for json_object
    after_thinking: str = ""  # "" or a THINKING parser: the constraint holds after it

    def grammar(self) -> str:
        """The llguidance grammar, compiled once per distinct constraint; ValueError with
        the library's message when the constraint is not valid."""
        return compile_grammar(self.kind, self.text, self.after_thinking)


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


def structural_tag_grammar(
    structures: list[tuple[str, dict | None, str]], triggers: list[str]
) -> str:
    """vLLM's structural tags (`response_format: {type: structural_tag}`) as a grammar
    (llguidance's Lark): free text holding none of `triggers`; where one comes, it opens
    one of the structures, (begin, JSON schema or None for any JSON, end): its begin, JSON
    the schema allows, its end; then free text again. The output may end in free text.
    A structure's begin and the free text before it are one lexeme, so the lexer never
    has to split text it has already read."""
    if not triggers or not all(triggers):
        raise ValueError("structural_tag: triggers must be non-empty strings")
    if not structures:
        raise ValueError("structural_tag: at least one structure")
    literal = functools.partial(json.dumps, ensure_ascii=False)  # Lark reads JSON's strings
    for begin, _, _ in structures:
        if not any(begin.startswith(t) for t in triggers):
            raise ValueError(f"structural_tag: begin {begin!r} starts with none of the triggers")
    held = " | ".join(literal(t) for t in triggers)
    free = rf"/(.|\n)*/ & ~(/(.|\n)*/ ({held}) /(.|\n)*/)"
    rules = ["start: tag* TEXT", "tag: " + " | ".join(f"tag{i}" for i in range(len(structures)))]
    for i, (begin, schema, end) in enumerate(structures):
        rules.append(f"tag{i}: OPEN{i} %json {literal(schema or {})} {literal(end)}")
        rules.append(f"OPEN{i}: ({free}) {literal(begin)}")
    return "\n".join([*rules, f"TEXT: {free}"])


@functools.lru_cache(maxsize=256)
def compile_grammar(kind: str, text: str, after_thinking: str = "") -> str:
    from llguidance import LLMatcher

    if after_thinking:
        if after_thinking not in THINKING:
            raise ValueError(f"after_thinking must be one of {', '.join(THINKING)}, or empty")
        answer = compile_grammar(kind, text)
        try:  # llguidance's grammar list, or (from Lark) the Lark text itself
            (first,) = json.loads(answer)["grammars"]
        except json.JSONDecodeError:
            first = {"lark_grammar": answer}
        top = {"lark_grammar": THINKING[after_thinking]}
        return _checked(json.dumps({"grammars": [top, {**first, "name": "answer"}]}), kind)

    if kind == "json_object":
        grammar = LLMatcher.grammar_from_json_schema({"type": "object"})
    elif kind == "json_schema":
        schema = json_text.loads_object(text, "json_schema")
        grammar = LLMatcher.grammar_from_json_schema(schema)
    elif kind == "regex":
        grammar = LLMatcher.grammar_from_regex(text)
    elif kind == "grammar":
        grammar = LLMatcher.grammar_from_lark(text)
    else:
        raise ValueError(f"unknown constraint kind {kind!r}; expected one of {KINDS}")
    return _checked(grammar, kind)


def _checked(grammar: str, kind: str) -> str:
    from llguidance import LLMatcher

    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"invalid {kind}: {error.strip()}")
    return grammar
