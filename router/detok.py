"""Streaming detokenisation that never splits a UTF-8 character, and exact stop strings."""

from __future__ import annotations


class IncrementalDetokenizer:
    """Decode a growing token list into text deltas.

    Decoding token by token breaks multi-byte characters (a byte-level BPE token may hold
    half of one: it decodes to U+FFFD). Keep a window from `prefix` (already-settled
    context, so merges and leading spaces decode right) and only release text once the
    window's decoding no longer ends in U+FFFD.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0  # window start
        self.read = 0  # tokens whose text was released

    def push(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix : self.read], skip_special_tokens=self.skip)
        now = decode(self.ids[self.prefix :], skip_special_tokens=self.skip)
        if now.endswith("\ufffd") or len(now) <= len(before):
            return ""  # an incomplete character (or nothing new): wait for more tokens
        self.prefix, self.read = self.read, len(self.ids)
        return now[len(before) :]


def may_begin(text: str, marker: str) -> int:
    """How many characters at the end of `text` might begin `marker` (text a stream holds
    back until it knows)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class StopStrings:
    """Hold back text that might be the start of a stop string; cut exactly at one (after
    it with `include`, vLLM's include_stop_str_in_output). Each stop string is looked for
    where it would end in text fed since the last look, so text fed with `search=False`
    (vLLM's min_tokens: the first tokens' text) is never cut, a stop reaching past it is."""

    def __init__(self, stops: list[str], include: bool = False):
        self.stops = [s for s in stops if s]
        self.include = include
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.sent = 0
        self.looked = 0  # text up to here was looked at (or exempt)
        self.stopped = False
        self.matched = ""  # the stop string that cut it

    def feed(self, delta: str, search: bool = True) -> str:
        """Add text; return what can be released now (empty once stopped)."""
        if self.stopped:
            return ""
        self.text += delta
        hits = [(i, s) for s in self.stops if search and (i := self._find(s)) >= 0]
        self.looked = len(self.text)
        if hits:
            at, self.matched = min(hits, key=lambda hit: hit[0])
            self.stopped = True
            self.text = self.text[: at + len(self.matched) * self.include]
            return self._release(len(self.text))
        return self._release(len(self.text) - self.hold if self.stops else len(self.text))

    def _find(self, stop: str) -> int:
        return self.text.find(stop, max(0, self.looked - len(stop) + 1))

    def flush(self) -> str:
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        out, self.sent = self.text[self.sent : upto], upto
        return out
