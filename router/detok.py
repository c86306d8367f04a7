"""Streaming detokenisation that never splits a UTF-8 character, and exact stop strings."""

from __future__ import annotations


class IncrementalDetokenizer:
    """Decode a growing token list into text deltas.

    Decoding token by token breaks multi-byte characters (a byte-level BPE token may hold
    half of one: it decodes to U+FFFD). Keep a window from `prefix` (already-settled
    context, so merges and leading spaces decode right) and only release text once the
    window's decoding no longer ends in U+FFFD.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # window start
        self.read = 0  # tokens whose text was released

    def push(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix : self.read], skip_special_tokens=True)
        now = decode(self.ids[self.prefix :], skip_special_tokens=True)
        if now.endswith("\ufffd") or len(now) <= len(before):
            return ""  # an incomplete character (or nothing new): wait for more tokens
        self.prefix, self.read = self.read, len(self.ids)
        return now[len(before) :]


class StopStrings:
    """Hold back text that might be the start of a stop string; cut exactly at one."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.sent = 0
        self.stopped = False

    def feed(self, delta: str) -> str:
        """Add text; return what can be released now (empty once stopped)."""
        if self.stopped:
            return ""
        start = max(0, len(self.text) - self.hold)  # a stop may straddle the old tail
        self.text += delta
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            self.text = self.text[: min(hits)]
            return self._release(len(self.text))
        return self._release(len(self.text) - self.hold if self.stops else len(self.text))

    def flush(self) -> str:
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        out, self.sent = self.text[self.sent : upto], upto
        return out
