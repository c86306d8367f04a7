"""A reasoning model's thinking, read apart from its answer (the router's
`--reasoning-parser`, vLLM's flag and names): the text between `<think>` and `</think>`.

- `deepseek_r1`: the output starts in the thinking (its template opens the tag in the
  prompt; a `<think>` the model writes itself is dropped) and thinks until `</think>`;
  an output that never closes it is all thinking. DeepSeek-R1 and the Qwen3 models whose
  template opens the tag (the 2507 thinking ones).
- `qwen3`: the output thinks only where it opens with `<think>` (leading whitespace
  aside), until `</think>`; otherwise it is all answer (Qwen3 with `enable_thinking:
  false`, whose template writes an empty think block into the prompt).

Whole or streamed, the split is the same: a reader holds back text that may still be
part of a tag. Without a parser (the default, as in vLLM) the thinking stays in the text."""

from __future__ import annotations

from router.detok import may_begin
from specd.constraint import THINKING

OPEN, CLOSE = "<think>", "</think>"
PARSERS = tuple(THINKING)  # each also names how a constraint waits for its thinking


def check_parser(name: str) -> str | None:
    """The router's `--reasoning-parser` ("" = none), checked."""
    if name and name not in PARSERS:
        raise ValueError(f"reasoning_parser must be one of {', '.join(PARSERS)}, or empty")
    return name or None


class ThinkReader:
    """One choice's text as it streams -> (thinking, answer) deltas; the newlines that
    follow `</think>` are dropped."""

    def __init__(self, parser: str):
        self.parser = parser
        self.state = "open?"  # may the output still open with <think>? then thinking, answer
        self.buf = ""
        self.lead = True  # the answer's leading newlines are still to drop

    def read(self, text: str, final: bool) -> tuple[str, str]:
        self.buf += text
        thinking = answer = ""
        while self.buf or (final and self.state == "open?"):
            if self.state == "open?":
                head = self.buf.lstrip()
                if head.startswith(OPEN):
                    self.buf, self.state = head[len(OPEN) :], "thinking"
                elif OPEN.startswith(head) and not final:
                    break  # whitespace and part of the tag so far: wait
                else:  # no tag: deepseek_r1 thinks anyway, qwen3 answers
                    self.state = "thinking" if self.parser == "deepseek_r1" else "answer"
            elif self.state == "thinking":
                at = self.buf.find(CLOSE)
                if at < 0:
                    keep = 0 if final else may_begin(self.buf, CLOSE)
                    thinking += self.buf[: len(self.buf) - keep]
                    self.buf = self.buf[len(self.buf) - keep :]
                    break
                thinking += self.buf[:at]
                self.buf, self.state = self.buf[at + len(CLOSE) :], "answer"
            else:
                if self.lead:
                    self.buf = self.buf.lstrip("\n")
                    self.lead = not self.buf
                answer += self.buf
                self.buf = ""
        return thinking, answer


class AnswerReader:
    """One choice's text -> (thinking, answer, tool calls completed): the thinking read
    apart where a parser is set, then the calls in the answer where the request has tools
    (a router.tools reader)."""

    def __init__(self, parser: str | None, tools_reader=None):
        self.thinker = ThinkReader(parser) if parser else None
        self.tools = tools_reader

    def read(self, text: str, final: bool) -> tuple[str, str, list]:
        thinking = ""
        if self.thinker is not None:
            thinking, text = self.thinker.read(text, final)
        if self.tools is None:
            return thinking, text, []
        content, calls = self.tools.read(text, final)
        return thinking, content, calls
