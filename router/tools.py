"""Tool calls in a chat: what the OpenAI API's `tools` and `tool_choice` ask of specd, and
the calls read back out of the model's text. Torch-free, as the rest of the door.

The chat template renders the tools (router.prepare hands them to it as `tools`, as
transformers does), so the model sees them as it was trained to. Then, by `tool_choice`:
- "auto" (the default with tools): the model decides. Its text is read for calls in the
  format its template teaches, as vLLM's parser of that name reads it: `hermes` (Qwen2.5,
  Hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, text around them
  kept) or `llama3_json` (Llama 3.1 to 3.3: the whole output one JSON object
  `{"name": ..., "parameters": {...}}`, or several joined by ";"). Found calls finish the
  choice with "tool_calls".
- "required": the output is constrained to a JSON array of one or more
  `{"name", "parameters"}` objects of the given tools (at most one where
  `parallel_tool_calls` is false, which keeps an "auto" answer's first call only, as
  vLLM does), vLLM's way, which any model can follow.
- a named function: the output is constrained to that function's parameters and is the
  call's arguments.
- "none": the tools are rendered; the output is text.
A call the model writes but that is not JSON stays in the content, as the model wrote it.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from router.detok import may_begin
from specd import json_text

HERMES = "hermes"
LLAMA3_JSON = "llama3_json"
FORMATS = (HERMES, LLAMA3_JSON)
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
# a function that names no parameters takes none (the OpenAI API's reading)
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def call_format(parser: str, template: str | None) -> str | None:
    """The tool-call format to read: the router's `--tool-call-parser`, where it names one
    (vLLM's flag), else ("auto") the one the chat template teaches."""
    if parser == "auto":
        return format_of(template)
    if parser not in FORMATS:
        raise ValueError(f"tool_call_parser must be auto or one of {', '.join(FORMATS)}")
    return parser


def format_of(template: str | None) -> str | None:
    """The tool-call format a chat template teaches its model, if specd reads it."""
    template = str(template or "")
    if _OPEN in template:
        return HERMES
    if "<|python_tag|>" in template or '"parameters": dictionary' in template:
        return LLAMA3_JSON
    return None


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # a JSON object, as text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_dict(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function"}
        out["function"] = {"name": self.name, "arguments": self.arguments}
        return out if index is None else {"index": index, **out}


def _call(obj: Any) -> Call | None:
    """A call from a parsed {"name", "arguments" | "parameters"} object, or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return Call(obj["name"], json.dumps(args, ensure_ascii=False))


def _loads(text: str) -> Any:
    try:
        return json_text.loads(text)
    except ValueError:
        return None


class Reader:
    """Reads one choice's text as it streams: `feed` and then `flush` each return the
    content that can go out now and the calls completed. The whole text fed at once reads
    the same as streamed."""

    def feed(self, text: str) -> tuple[str, list[Call]]:
        raise NotImplementedError

    def flush(self) -> tuple[str, list[Call]]:
        raise NotImplementedError

    def read(self, text: str, final: bool) -> tuple[str, list[Call]]:
        """`feed`, then `flush` too where `text` is the last."""
        content, calls = self.feed(text)
        if final:
            more, last = self.flush()
            content, calls = content + more, calls + last
        return content, calls


class HermesReader(Reader):
    """Content streams until a `<tool_call>` opens (a tail that might begin one is held);
    each call goes out when its `</tool_call>` closes it (or at the end, unclosed). After
    the first call, whitespace between calls is not content."""

    def __init__(self):
        self.buf = ""
        self.inside = False
        self.called = False

    def feed(self, text: str) -> tuple[str, list[Call]]:
        self.buf += text
        content, calls = [], []
        while True:
            if not self.inside:
                at = self.buf.find(_OPEN)
                end = at if at >= 0 else len(self.buf) - may_begin(self.buf, _OPEN)
                content.append(self._content(self.buf[:end]))
                if at < 0:
                    self.buf = self.buf[end:]
                    break
                self.buf, self.inside = self.buf[at + len(_OPEN) :], True
            else:
                at = self.buf.find(_CLOSE)
                if at < 0:
                    break
                body, self.buf, self.inside = self.buf[:at], self.buf[at + len(_CLOSE) :], False
                self._read(body, _OPEN + body + _CLOSE, content, calls)
        return "".join(content), calls

    def flush(self) -> tuple[str, list[Call]]:
        content, calls = [], []
        if self.inside:  # the model stopped inside a call
            self._read(self.buf, _OPEN + self.buf, content, calls)
        else:
            content.append(self._content(self.buf))
        self.buf, self.inside = "", False
        return "".join(content), calls

    def _read(self, body: str, raw: str, content: list, calls: list) -> None:
        call = _call(_loads(body))
        if call is None:
            content.append(raw)
        else:
            calls.append(call)
            self.called = True

    def _content(self, text: str) -> str:
        return "" if self.called and not text.strip() else text


class WholeReader(Reader):
    """Reads the whole output at the end (`calls_of`: text -> calls, or None: it is
    content)."""

    def __init__(self, calls_of):
        self.calls_of = calls_of
        self.buf = ""

    def feed(self, text: str) -> tuple[str, list[Call]]:
        self.buf += text
        return "", []

    def flush(self) -> tuple[str, list[Call]]:
        text, self.buf = self.buf, ""
        calls = self.calls_of(text)
        return ("", calls) if calls else (text, [])


class Llama3Reader(Reader):
    """The output is a call if it opens with "{" (leading whitespace aside): then it is
    read whole at the end; otherwise it streams as content."""

    def __init__(self):
        self.head = ""
        self.whole: WholeReader | None = None
        self.text = False

    def feed(self, text: str) -> tuple[str, list[Call]]:
        if self.whole is not None:
            return self.whole.feed(text)
        if self.text:
            return text, []
        self.head += text
        if not self.head.strip():
            return "", []
        if self.head.lstrip().startswith("{"):
            self.whole = WholeReader(_llama3_calls)
            return self.whole.feed(self.head)
        self.text = True
        return self.head, []

    def flush(self) -> tuple[str, list[Call]]:
        if self.whole is not None:
            return self.whole.flush()
        return ("", []) if self.text else (self.head, [])


def _llama3_calls(text: str) -> list[Call] | None:
    """`{...}` or `{...}; {...}`, each with a name and parameters; None if not that."""
    if json_text.too_deep(text):
        return None
    decoder, calls, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and text[at] in " \t\r\n;":
            at += 1
        if at == len(text):
            return calls or None
        try:
            obj, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        call = _call(obj)
        if call is None:
            return None
        calls.append(call)


class OneCallReader(Reader):
    """Another reader's content and its first call only (`parallel_tool_calls: false`)."""

    def __init__(self, inner: Reader):
        self.inner = inner
        self.called = False

    def feed(self, text: str) -> tuple[str, list[Call]]:
        return self._first(*self.inner.feed(text))

    def flush(self) -> tuple[str, list[Call]]:
        return self._first(*self.inner.flush())

    def _first(self, content: str, calls: list[Call]) -> tuple[str, list[Call]]:
        calls, self.called = ([] if self.called else calls[:1]), self.called or bool(calls)
        return content, calls


class PlainReader(Reader):
    def feed(self, text: str) -> tuple[str, list[Call]]:
        return text, []

    def flush(self) -> tuple[str, list[Call]]:
        return "", []


@dataclass(frozen=True)
class ToolUse:
    """A chat's tools and tool choice, checked: the constraint it needs (None: none), and
    how its text is read."""

    tools: list[dict]  # OpenAI's [{"type": "function", "function": {...}}]
    choice: str | dict  # "none", "auto", "required" or {"function": {"name"}}
    parallel: bool = True
    format: str | None = None  # the template's call format

    def __post_init__(self):
        names = [t["function"]["name"] for t in self.tools]
        if isinstance(self.choice, dict) and self.choice["function"]["name"] not in names:
            raise ValueError(
                f"tool_choice names {self.choice['function']['name']!r}, not one of the tools"
            )
        if self.choice == "auto" and self.format is None:
            raise ValueError(
                "tool_choice 'auto' needs a chat template whose tool-call format specd reads "
                f"({', '.join(FORMATS)}); this model's is neither: use 'required' or name a "
                "function"
            )

    def finish(self, finish: str, called: bool) -> str:
        """A choice's finish reason once its text is read: "tool_calls" where it called a
        tool under "auto", or under "required" where it stopped of itself; a named
        function's call finishes as it did ("stop"), as in OpenAI's API and vLLM's."""
        if called and (self.choice == "auto" or (self.choice == "required" and finish == "stop")):
            return "tool_calls"
        return finish

    def schema(self) -> dict | None:
        """The JSON schema the output must follow, if the choice forces a call."""
        if isinstance(self.choice, dict):
            return self._parameters(self.choice["function"]["name"])
        if self.choice != "required":
            return None
        one_of = [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [name]},
                    "parameters": self._parameters(name),
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name in dict.fromkeys(t["function"]["name"] for t in self.tools)
        ]
        array = {"type": "array", "minItems": 1, "items": {"anyOf": one_of}}
        return array if self.parallel else {**array, "maxItems": 1}

    def _parameters(self, name: str) -> dict:
        for tool in self.tools:
            if tool["function"]["name"] == name:
                return tool["function"].get("parameters") or NO_PARAMETERS
        raise KeyError(name)

    def reader(self) -> Reader:
        """A fresh reader for one choice's text."""
        if isinstance(self.choice, dict):
            name = self.choice["function"]["name"]
            return WholeReader(lambda text: [Call(name, text)])
        if self.choice == "required":
            return WholeReader(_required_calls)
        if self.choice == "auto":
            reader = HermesReader() if self.format == HERMES else Llama3Reader()
            return reader if self.parallel else OneCallReader(reader)
        return PlainReader()


def _required_calls(text: str) -> list[Call] | None:
    items = _loads(text)
    if not isinstance(items, list):
        return None
    calls = [_call(item) for item in items]
    return calls if calls and all(calls) else None
