"""Combined drafting: the n-gram continuation where the text repeats, the draft model
elsewhere.

A sequence whose last `min_match` tokens occurred earlier (code being edited with the
source in the prompt, an answer quoting its context, a repeated identifier) gets the
n-gram proposal: it costs nothing to produce and is long when text is being copied. Every
other sequence gets the draft model's proposal. The draft model catches up on the tokens
it did not see the next time it drafts for that sequence (one multi-token forward, about
the cost of one token here). Exactness is untouched: an n-gram proposal carries no q, so
the verifier treats it as one-hot, like any deterministic draft.
"""

from __future__ import annotations

from specd.lookup import (
    COMBINED_MAX_N,
    COMBINED_MIN_MATCH,
    LookupAhead,
    Lookups,
    lookup,
    lookup_then_model,
)
from specd.proposal import DraftState, Proposal, Proposer


class CombinedProposer:
    def __init__(
        self, model: Proposer, min_match: int = COMBINED_MIN_MATCH, max_n: int = COMBINED_MAX_N
    ):
        self.model = model
        self.min_match, self.max_n = min_match, max_n
        self.lookups = Lookups(max_n, min_match)
        self._ahead = LookupAhead(lambda s: self._lookup(s, commit=False))

    @property
    def combined_lookup(self) -> bool:
        """Whether its lookup is specd/lookup.py's `combined` window (the handshake says
        so: a verifier may look it up itself)."""
        return (self.max_n, self.min_match) == (COMBINED_MAX_N, COMBINED_MIN_MATCH)

    @property
    def available(self) -> bool:
        return self.model.available

    @property
    def context_window(self) -> int:
        return getattr(self.model, "context_window", 0)

    def propose(self, states: list[DraftState]) -> list[Proposal]:
        found = [self._lookup(s) for s in states]
        self._ahead.record((s, p) for s, p in zip(states, found, strict=True) if p is not None)
        return lookup_then_model(states, found, self.model)

    def draft_ahead(self, stop=lambda: False) -> list[tuple[DraftState, Proposal]]:
        """The model's rounds ahead and the lookup's (LookupAhead), each from the
        sequences it drafted last."""
        return self.model.draft_ahead(stop) + self._ahead.draft()

    def _lookup(self, s: DraftState, commit: bool = True) -> Proposal | None:
        return lookup(s, self.lookups.follow(s, commit))

    def close(self, seq_id) -> None:
        self._ahead.close(seq_id)
        self.lookups.close(seq_id)
        self.model.close(seq_id)

    def forget_cached(self) -> None:
        self.model.forget_cached()
