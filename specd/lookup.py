"""Prompt lookup (n-gram drafting): continue the sequence the way it continued before.

`ngram_propose` says what a lookup drafts; `NgramIndex` answers the same for one sequence
in time that does not grow with its length, by keeping where each of its n-grams last
ended as its tokens commit (a scan of a 2,000-token text is ~0.5 ms of Python a round, a
sequence, where the step it drafts for may be a few ms on a GPU); `Lookups` keeps one
index an open sequence. `NgramProposer` drafts by it, in the drafter (`--proposer ngram`)
or in the verifier (`--lookup`: no drafter, no round trip), as vLLM's `ngram` method does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from specd.proposal import DraftState, Proposal, Proposer, continuable


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
        end = _latest_end(tokens, n, size - 1, n)
        if end is not None:
            return tokens[end : end + k]
    return []


def _latest_end(tokens: list[int], n: int, last: int, first: int) -> int | None:
    """The largest end e in [first, last] where tokens[e - n : e] is the last n tokens (an
    occurrence that a token follows, for last < len(tokens)), or None."""
    suffix = tokens[len(tokens) - n :]
    for end in range(last, max(first, n) - 1, -1):
        if tokens[end - n : end] == suffix:
            return end
    return None


class NgramIndex:
    """One sequence's n-grams of min_n..max_n tokens, each to the end of its latest
    occurrence that a token follows (keyed by hash, checked against the tokens when read).

    `follow(tokens, k)` answers as `ngram_propose(tokens, k, max_n, min_n)`. The index
    covers the tokens it has seen; a sequence's committed tokens only grow, and
    `commit=True` adds the new ones (each n-gram once). Tokens past those it covers (a
    state drafted ahead, with tokens not committed: `commit=False`) are scanned, so they
    never enter it; tokens that do not extend what it saw (another sequence's) start it
    over."""

    def __init__(self, max_n: int, min_n: int):
        self.max_n, self.min_n = max_n, min_n
        self.covered = 0  # how many of the sequence's tokens the index covers
        self._last = -1  # the last of them (a cheap check that `tokens` extends them)
        self._ends: dict[int, int] = {}  # hash of an n-gram -> its latest end a token follows

    def follow(self, tokens: list[int], k: int, commit: bool = True) -> list[int]:
        if k <= 0:
            return []
        size = len(tokens)
        if size < self.covered or (self.covered and tokens[self.covered - 1] != self._last):
            self.covered, self._last = 0, -1
            self._ends.clear()
        if commit:
            self._add(tokens)
        past = self.covered < size  # tokens the index does not cover (not committed)
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            # the ends the index does not cover first: they are the latest
            end = _latest_end(tokens, n, size - 1, self.covered) if past else None
            if end is None:
                end = self._indexed_end(tokens, n)
            if end is not None:
                return tokens[end : end + k]
        return []

    def _add(self, tokens: list[int]) -> None:
        """Index the n-grams that end before the last token (a token follows them)."""
        ends, low, high = self._ends, self.min_n, self.max_n
        for end in range(max(self.covered, low), len(tokens)):
            for n in range(low, min(high, end) + 1):
                ends[hash(tuple(tokens[end - n : end]))] = end
        if len(tokens) > self.covered:
            self.covered, self._last = len(tokens), tokens[-1]

    def _indexed_end(self, tokens: list[int], n: int) -> int | None:
        """The latest end the index holds for the last n tokens, or None; a hash that
        another n-gram shares (it is checked) falls back to scanning what it covers."""
        suffix = tokens[len(tokens) - n :]
        end = self._ends.get(hash(tuple(suffix)))
        if end is None or end >= self.covered:
            return None
        if tokens[end - n : end] == suffix:
            return end
        return _latest_end(tokens, n, self.covered - 1, n)


class Lookups:
    """An NgramIndex for each open sequence, for a proposer that looks up many."""

    def __init__(self, max_n: int, min_n: int):
        self.max_n, self.min_n = max_n, min_n
        self._by_seq: dict[object, NgramIndex] = {}

    def follow(self, s: DraftState, commit: bool = True) -> list[int]:
        """`s`'s lookup drafts (up to s.k); `commit`: its tokens are committed ones."""
        index = self._by_seq.get(s.seq_id)
        if index is None:
            index = self._by_seq[s.seq_id] = NgramIndex(self.max_n, self.min_n)
        return index.follow(s.tokens, s.k, commit)

    def close(self, seq_id) -> None:
        self._by_seq.pop(seq_id, None)

    def __len__(self) -> int:
        return len(self._by_seq)


def allowed_prefix(s: DraftState, tokens: list[int]) -> list[int]:
    """A constrained sequence's drafts, cut at the first its grammar forbids."""
    return tokens if s.grammar is None else tokens[: s.grammar.valid_prefix(tokens)]


# `combined`'s lookup (drafter_service/combined.py): suffixes of 8 tokens down to 3, where
# the draft model drafts otherwise; the verifier looks it up itself where its drafter says
# it drafts so (verifier_service/drafter_client.py)
COMBINED_MAX_N, COMBINED_MIN_MATCH = 8, 3


def lookup(s: DraftState, tokens: list[int], alts=()) -> Proposal | None:
    """A lookup's drafts as a deterministic proposal (cut where a grammar forbids; the
    alternatives only beside drafts kept, and none under a grammar), None if none."""
    tokens = allowed_prefix(s, tokens)
    if not tokens:
        return None
    kept = [] if s.grammar is not None else [(p, t) for p, t in alts if p < len(tokens)]
    return Proposal(tokens=tokens, alts=kept, ngram=True)


def lookup_then_model(
    states: list[DraftState], found: list[Proposal | None], model: Proposer | None
) -> list[Proposal]:
    """Each state's lookup proposal where `found` has one; where it has None, the model's
    proposal (one call for all of them), or no drafts without a model."""
    asked = [s for s, p in zip(states, found, strict=True) if p is None]
    drafted = iter(model.propose(asked) if asked and model is not None else [])
    return [p if p is not None else next(drafted, Proposal()) for p in found]


class LookupAhead:
    """A lookup's drafting ahead (see DraftModelProposer.draft_ahead), for a proposer
    that drafts by `look`: from the rounds it last drafted whole (`record`), each the
    state it leads to if every draft is accepted and the target's next token is the one
    `look` continues with, and `look`'s drafts there; called again, the round after.
    `look` is handed states whose last tokens are not committed."""

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
    drafter = "ngram"  # what it drafts with (the verifier's Info, where it runs there)

    def __init__(self, max_n: int = 4, min_n: int = 1):
        self.max_n, self.min_n = max_n, min_n
        self.lookups = Lookups(max_n, min_n)
        self._ahead = LookupAhead(lambda s: self._lookup(s, commit=False))

    def propose(self, states: list[DraftState]) -> list[Proposal]:
        out = [self._lookup(s) for s in states]
        self._ahead.record(zip(states, out, strict=True))
        return out

    def draft_ahead(self, stop=lambda: False) -> list[tuple[DraftState, Proposal]]:
        return self._ahead.draft()

    def _lookup(self, s: DraftState, commit: bool = True) -> Proposal:
        return Proposal(tokens=allowed_prefix(s, self.lookups.follow(s, commit)), ngram=True)

    def close(self, seq_id) -> None:
        self._ahead.close(seq_id)
        self.lookups.close(seq_id)

    def forget_cached(self) -> None:
        pass  # a lookup holds no K/V
