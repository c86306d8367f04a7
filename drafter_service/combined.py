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

from drafter_service.ngram import allowed_prefix, ngram_propose
from specd.proposal import DraftState, Proposal, Proposer

MIN_MATCH, MAX_N = 3, 8  # the lookup: suffixes of 8 tokens down to 3


class CombinedProposer:
    def __init__(self, model: Proposer, min_match: int = MIN_MATCH, max_n: int = MAX_N):
        self.model = model
        self.min_match, self.max_n = min_match, max_n

    @property
    def available(self) -> bool:
        return self.model.available

    def propose(self, states: list[DraftState]) -> list[Proposal]:
        out: list[Proposal | None] = []
        for s in states:
            tokens = allowed_prefix(s, ngram_propose(s.tokens, s.k, self.max_n, self.min_match))
            out.append(Proposal(tokens=tokens, ngram=True) if tokens else None)
        rest = [s for s, p in zip(states, out, strict=True) if p is None]
        drafted = iter(self.model.propose(rest) if rest else [])
        return [p if p is not None else next(drafted) for p in out]

    def draft_ahead(self, stop=lambda: False) -> None:
        self.model.draft_ahead(stop)

    def close(self, seq_id) -> None:
        self.model.close(seq_id)
