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

from specd.lookup import LookupAhead, Lookups, allowed_prefix
from specd.proposal import DraftState, Proposal, Proposer

MIN_MATCH, MAX_N = 3, 8  # the lookup: suffixes of 8 tokens down to 3


def lookup_then_model(
    states: list[DraftState], found: list[Proposal | None], model: Proposer | None
) -> list[Proposal]:
    """Each state's lookup proposal where `found` has one; where it has None, the model's
    proposal (one call for all of them), or no drafts without a model."""
    asked = [s for s, p in zip(states, found, strict=True) if p is None]
    drafted = iter(model.propose(asked) if asked and model is not None else [])
    return [p if p is not None else next(drafted, Proposal()) for p in found]


def lookup(s: DraftState, tokens: list[int], alts=()) -> Proposal | None:
    """A lookup's drafts as a deterministic proposal (cut where a grammar forbids; the
    alternatives only beside drafts kept, and none under a grammar), None if none."""
    tokens = allowed_prefix(s, tokens)
    if not tokens:
        return None
    kept = [] if s.grammar is not None else [(p, t) for p, t in alts if p < len(tokens)]
    return Proposal(tokens=tokens, alts=kept, ngram=True)


class CombinedProposer:
    def __init__(self, model: Proposer, min_match: int = MIN_MATCH, max_n: int = MAX_N):
        self.model = model
        self.min_match, self.max_n = min_match, max_n
        self.lookups = Lookups(max_n, min_match)
        self._ahead = LookupAhead(lambda s: self._lookup(s, commit=False))

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
