"""A proposer at a controlled acceptance, for measuring speculation on random weights.

It proposes the target's own greedy continuation (recorded from a plain run of the same
prompt) with probability `acceptance` per draft, else another token, so the verifier
accepts each draft with that probability until the first miss. With a draft model
(`inner`) it first runs that model's real forwards and discards their tokens, so a round
costs what a draft model's round costs; without one its drafts cost nothing, as an
n-gram lookup's. Drafts are deterministic (no q): greedy verification is exact for any
proposal, so the output must still be the target's own."""

from __future__ import annotations

import random

from specd.lookup import LookupAhead
from specd.proposal import DraftState, Proposal


class ControlledProposer:
    available = True

    def __init__(
        self, recorded: dict[tuple, list[int]], vocab: int, acceptance: float, inner=None, seed=0
    ):
        self.recorded = recorded  # prompt -> the target's greedy continuation
        self.vocab = vocab
        self.prompt_len = len(next(iter(recorded)))
        self.acceptance = acceptance
        self.inner = inner
        self.rng = random.Random(seed)
        self._ahead = LookupAhead(self._drafts)

    @property
    def lookup_only(self) -> bool:
        return self.inner is None  # a lookup's cost: none (specd/lookup.py)

    def propose(self, states: list[DraftState]) -> list[Proposal]:
        if self.inner is not None:
            self.inner.propose(states)  # the draft model's forwards, for their cost
        out = [self._drafts(s) for s in states]
        self._ahead.record(zip(states, out, strict=True))
        return out

    def draft_ahead(self, stop=lambda: False) -> list[tuple[DraftState, Proposal]]:
        """The next rounds as a lookup drafts them ahead, the target's next token guessed
        right with the same chance as a draft (after the draft model's own work ahead, for
        its cost)."""
        if self.inner is not None and hasattr(self.inner, "draft_ahead"):
            self.inner.draft_ahead(stop)
        return self._ahead.draft()

    def _drafts(self, state: DraftState) -> Proposal:
        prompt = tuple(state.tokens[: self.prompt_len])
        done = len(state.tokens) - self.prompt_len
        target = self.recorded[prompt][done : done + state.k]
        drafts = [
            t if self.rng.random() < self.acceptance else (t + 1) % self.vocab for t in target
        ]
        return Proposal(drafts, ngram=self.inner is None)

    def close(self, seq_id) -> None:
        if self.inner is not None:
            self.inner.close(seq_id)

    def forget_cached(self) -> None:
        if self.inner is not None:
            self.inner.forget_cached()
