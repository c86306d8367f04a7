"""Prompt-lookup / n-gram drafting: continue the sequence the way it continued before."""

from __future__ import annotations

from specd.proposal import DraftState, Proposal


def ngram_propose(tokens: list[int], k: int, max_n: int = 4, min_n: int = 1) -> list[int]:
    """Find the longest suffix of `tokens` (max_n down to min_n tokens) that occurred earlier,
    take its most recent earlier occurrence, and propose up to k tokens that followed it.

    Worked example, k = 3, max_n = 3:
        tokens = [7, 1, 2, 3, 9, 4, 1, 2, 3]
        suffix n=3 is [1, 2, 3]; it occurred earlier at index 1..3, followed by [9, 4, 1]
        -> [9, 4, 1]
    With no earlier occurrence of any suffix of length >= min_n the answer is [] (no drafts).
    """
    size = len(tokens)
    if k <= 0:
        return []
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = tokens[size - n :]
        # scan right to left so the most recent earlier match wins
        for start in range(size - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                follow = tokens[start + n : start + n + k]
                if follow:
                    return follow
    return []


def allowed_prefix(s: DraftState, tokens: list[int]) -> list[int]:
    """A constrained sequence's drafts, cut at the first its grammar forbids."""
    return tokens if s.grammar is None else tokens[: s.grammar.valid_prefix(tokens)]


class NgramProposer:
    available = True

    def __init__(self, max_n: int = 4, min_n: int = 1):
        self.max_n, self.min_n = max_n, min_n

    def propose(self, states: list[DraftState]) -> list[Proposal]:
        return [
            Proposal(
                tokens=allowed_prefix(s, ngram_propose(s.tokens, s.k, self.max_n, self.min_n)),
                ngram=True,
            )
            for s in states
        ]

    def close(self, seq_id) -> None:  # stateless
        pass
