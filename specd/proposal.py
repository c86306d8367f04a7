"""The one small interface every proposer implements.

The verifier tells a proposer, per sequence, the committed tokens (prompt + generated; they
only ever grow) and how many drafts it wants; the proposer returns k tokens and the
distribution q each was drawn from (sparse), or no q when it drafts deterministically
(greedy drafting, n-gram): then q is one-hot at each token. It may add alternative
leaves: one more candidate token beside a draft, verified in the same forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from specd.params import SamplingParams


@dataclass
class DraftState:
    seq_id: object
    tokens: list[int]  # committed: prompt + generated so far
    params: SamplingParams
    k: int  # drafts wanted this round (may come back shorter)
    span: object = None  # the request's trace span, for a remote drafter's session span
    # a constrained request's grammar (specd.grammar.GrammarState) at `tokens`: a proposer
    # drafts under its masks and must leave it as it found it
    grammar: object = None
    route: str = "default"  # the request's route (a suffix drafter shares within one)
    prompt_length: int = 0  # how many of `tokens` are the prompt
    proposer: str = ""  # how to draft for it (the route's choice); "": the drafter's own
    suffix_private: bool = False  # a suffix drafter neither keeps nor reads shared text
    cache_salt: str = ""  # the prefix cache's salt: cached K/V shared only under the same


@dataclass
class Proposal:
    tokens: list[int] = field(default_factory=list)
    q_ids: torch.Tensor | None = None  # [k, m] support of each position's truncated q
    q_probs: torch.Tensor | None = None  # [k, m] its probabilities (sum to 1 per row)
    # alternative leaves (parent, token): a deterministic sibling of tokens[parent], parent
    # in [0, k) (0: the pending token); verified side by side (verifier_service/tree.py)
    alts: list[tuple[int, int]] = field(default_factory=list)
    # the drafts are an n-gram continuation (specd/lookup.py), found by a lookup
    # in the committed tokens: no draft model ran for them, so their round costs the
    # drafter ~nothing and the verifier's step costs keep such rounds apart
    ngram: bool = False
    # the drafts are the client's predicted output's (specd/prediction.py; also `ngram`)
    predicted: bool = False

    def first(self, k: int) -> Proposal:
        """The first k drafts, with their q and the alternatives beside them."""
        q_ids = None if self.q_ids is None else self.q_ids[:k]
        q_probs = None if self.q_probs is None else self.q_probs[:k]
        alts = [(parent, t) for parent, t in self.alts if parent < k]
        return Proposal(list(self.tokens[:k]), q_ids, q_probs, alts, self.ngram, self.predicted)


def continuable(rounds) -> list[tuple[DraftState, Proposal]]:
    """Of (state, proposal) rounds, those a proposer may draft ahead from (as if accepted
    whole): those that got every draft they asked for, unconstrained (a grammar follows
    the committed tokens). References, no copies: a later hit compares the tokens it
    assumed, in full."""
    return [(s, p) for s, p in rounds if s.k > 0 and len(p.tokens) == s.k and s.grammar is None]


def view_start(n: int, window: int, cached: int = 0) -> int:
    """Where a draft model with a context window (DrafterConfig.context_window; 0: none)
    starts its view of a sequence of n tokens, `cached` of them in its prefix cache: at
    the first token where at most `window` need computing; else at the last multiple of
    `window` that leaves `window` or more, so that the turns of a conversation that start
    there find the turn before's blocks (K/V depend only on the tokens from the start)."""
    if not window or n - cached <= window:
        return 0
    return (n - window) // window * window


class Proposer(Protocol):
    available: bool  # False while a remote drafter cannot be reached
    # optional: `context_window`, the draft model's (view_start; absent or 0: none)

    def propose(self, states: list[DraftState]) -> list[Proposal]: ...

    def close(self, seq_id) -> None: ...

    def forget_cached(self) -> None:
        """Forget the K/V of cached prefixes (the verifier's prefix cache reset); a
        proposer that caches none does nothing."""
