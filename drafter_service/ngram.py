"""Prompt-lookup / n-gram drafting: continue the sequence the way it continued before."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from specd.proposal import DraftState, Proposal, continuable


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


class LookupAhead:
    """A lookup's drafting ahead (see DraftModelProposer.draft_ahead), for a proposer
    that drafts by `look`: from the rounds it last drafted whole (`record`), each the
    state it leads to if every draft is accepted and the target's next token is the one
    `look` continues with, and `look`'s drafts there; called again, the round after."""

    def __init__(self, look: Callable[[DraftState], Proposal | None]):
        self.look = look
        self._last: list[tuple[DraftState, Proposal]] = []

    def record(self, rounds) -> None:
        """The (state, proposal) rounds just drafted by `look` (continuable ones kept)."""
        self._last = continuable(rounds)

    def draft(self) -> list[tuple[DraftState, Proposal]]:
        made = []
        for s, p in self._last:
            drafted = replace(s, tokens=s.tokens + p.tokens, k=1)
            guess = self.look(drafted)
            if guess is not None and guess.tokens:
                assumed = replace(s, tokens=drafted.tokens + guess.tokens[:1])
                if (ahead := self.look(assumed)) is not None and ahead.tokens:
                    made.append((assumed, ahead))
        self.record(made)
        return made

    def close(self, seq_id) -> None:
        self._last = [(s, p) for s, p in self._last if s.seq_id != seq_id]


class NgramProposer:
    available = True
    lookup_only = True  # no model forward: microseconds a round, drafted ahead on any host

    def __init__(self, max_n: int = 4, min_n: int = 1):
        self.max_n, self.min_n = max_n, min_n
        self._ahead = LookupAhead(self._lookup)

    def propose(self, states: list[DraftState]) -> list[Proposal]:
        out = [self._lookup(s) for s in states]
        self._ahead.record(zip(states, out, strict=True))
        return out

    def draft_ahead(self, stop=lambda: False) -> list[tuple[DraftState, Proposal]]:
        return self._ahead.draft()

    def _lookup(self, s: DraftState) -> Proposal:
        return Proposal(
            tokens=allowed_prefix(s, ngram_propose(s.tokens, s.k, self.max_n, self.min_n)),
            ngram=True,
        )

    def close(self, seq_id) -> None:
        self._ahead.close(seq_id)

    def forget_cached(self) -> None:
        pass  # a lookup holds no K/V
