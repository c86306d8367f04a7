"""A client's predicted output (OpenAI's Predicted Outputs, the chat's `prediction`) as
drafts.

The client knows most of the answer: a file it asks to have edited and returned whole, a
document with a few lines changed. The verifier drafts from that text. It follows the
output along the prediction: while each committed token is the prediction's next, the
drafts are the tokens after it. Where the output leaves the prediction (an edit), it
finds its place again by the output's last tokens: the longest stretch of them that ends
somewhere in the prediction (two tokens at least), the first such place at or after where
it left (an edit rarely moves backwards), else the nearest before. Verification is the
same as for any draft, so the output is the target's own whatever the prediction says; a
good prediction only makes it faster.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

MAX_MATCH = 32  # longer matches rank as this long


class Prediction:
    """The predicted tokens and where the output stands in them."""

    def __init__(self, tokens: Iterable[int]):
        self.tokens = list(tokens)
        self.at: int | None = 0  # the prediction's next token for the output; None: lost
        self.left = 0  # where the output last left the prediction
        self.seen = 0  # output tokens followed so far
        self._ends: dict[tuple[int, int], list[int]] | None = None  # pair -> where it ends

    def follows(self, tokens: list[int], start: int) -> bool:
        """Whether the output (`tokens` from `start`) is somewhere in the prediction, with
        tokens of it still to come: its next round drafts from it."""
        self._follow(tokens, start)
        return self.at is not None and self.at < len(self.tokens)

    def drafts(self, tokens: list[int], start: int, k: int) -> list[int]:
        """Up to k tokens to draft after `tokens`, whose output (generated so far, only
        ever growing) begins at `start`; [] where the output is not in the prediction."""
        self._follow(tokens, start)
        if self.at is None or k <= 0:
            return []
        return self.tokens[self.at : self.at + k]

    def _follow(self, tokens: list[int], start: int) -> None:
        out = len(tokens) - start
        if out < self.seen:  # not the output followed so far: start over
            self.at, self.left, self.seen = 0, 0, 0
        for token in tokens[start + self.seen :]:
            if self.at is not None and self.at < len(self.tokens) and self.tokens[self.at] == token:
                self.at += 1
            elif self.at is not None:
                self.left, self.at = self.at, None
        if self.at is None and out > self.seen:
            self.at = self._find(tokens, out)
        self.seen = out

    def _find(self, tokens: list[int], out: int) -> int | None:
        """Where the longest match of the output's last tokens (`out` of them end
        `tokens`) ends, two at least (the index is of pairs): the first at or after
        `left`, else the last before it; None if none."""
        if out < 2:
            return None
        best, best_key = None, None
        for end in self._pairs().get((tokens[-2], tokens[-1]), ()):
            n = 2
            while n < MAX_MATCH and n < end and n < out:
                if self.tokens[end - n - 1] != tokens[-n - 1]:
                    break
                n += 1
            key = (n, end >= self.left, -abs(end - self.left))
            if best_key is None or key > best_key:
                best, best_key = end, key
        return best

    def _pairs(self) -> dict[tuple[int, int], list[int]]:
        """Each pair of adjacent predicted tokens -> the positions after it (built once)."""
        if self._ends is None:
            ends = defaultdict(list)
            for i in range(len(self.tokens) - 1):
                ends[(self.tokens[i], self.tokens[i + 1])].append(i + 2)
            self._ends = dict(ends)
        return self._ends
