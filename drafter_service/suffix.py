"""Suffix drafting: continue a sequence the way earlier text continued the same words, in
the request's own context and in what earlier responses of its route said (a coding agent
re-emitting a file it was shown, a tool call repeating the last one's arguments, a second
user asking what the first asked).

The drafts are deterministic (a lookup, no model), so the verifier treats them as one-hot
and exactness is that of every proposer. How far to speculate follows the evidence, as
SuffixDecoding (Oliaro et al., arXiv 2411.04975) does: a draft of at most as many tokens as
the match is long, and each further token only while most of the earlier occurrences
agree on it. Where they split, the draft goes wide instead of long: the leading token
ends the chain and the runner-up hangs beside it as an alternative leaf, and a runner-up
with votes hangs beside every chain token too (the verifier tests both in one forward,
verifier_service/tree.py).

The shared memory is per route (the policy separates routes, so text never crosses one),
bounded in tokens with the oldest responses evicted first, and can be turned off for the
whole drafter or for a route (its policy's `suffix_shared: false`).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from specd.lookup import (
    COMBINED_MAX_N,
    COMBINED_MIN_MATCH,
    LookupAhead,
    Lookups,
    lookup,
    lookup_then_model,
)
from specd.proposal import DraftState, Proposal, Proposer

KEY = 3  # tokens a lookup key holds: the index finds occurrences of the last KEY tokens
MAX_CANDIDATES = 32  # the most recent occurrences of a key that a lookup weighs
MAX_MATCH = 64  # how far back a match is measured
AGREE = 0.5  # a further draft needs more than this share of the matches to agree on it


@dataclass
class Match:
    tokens: list[int]  # the continuation proposed
    length: int  # tokens of context the occurrences matched
    alts: list[tuple[int, int]] = field(default_factory=list)  # (parent, token) leaves


class ResponseIndex:
    """Earlier responses of one route: their tokens, and every KEY-token window's
    positions, at most `max_tokens` tokens in all (the oldest responses go first)."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.docs: OrderedDict[int, list[int]] = OrderedDict()
        self.index: dict[tuple[int, ...], list[tuple[int, int]]] = {}
        self.tokens = 0
        self._next = 0

    def add(self, tokens: list[int]) -> None:
        if len(tokens) <= KEY or len(tokens) > self.max_tokens:
            return
        doc, self._next = self._next, self._next + 1
        self.docs[doc] = list(tokens)
        self.tokens += len(tokens)
        for end in range(KEY, len(tokens)):  # the window ending before `end` -> tokens[end]
            self.index.setdefault(tuple(tokens[end - KEY : end]), []).append((doc, end))
        while self.tokens > self.max_tokens:
            self._evict()

    def _evict(self) -> None:
        doc, tokens = self.docs.popitem(last=False)
        self.tokens -= len(tokens)
        for end in range(KEY, len(tokens)):
            key = tuple(tokens[end - KEY : end])
            kept = [(d, e) for d, e in self.index[key] if d != doc]
            if kept:
                self.index[key] = kept
            else:
                del self.index[key]

    def continuation(self, context: list[int], k: int, alternatives: int = 0) -> Match:
        """The drafts the stored responses suggest after `context`: the occurrences of its
        last KEY tokens that match furthest back vote, token by token. With `alternatives`
        > 0, up to that many runners-up as (parent, token) leaves beside the chain."""
        if k <= 0 or len(context) < KEY:
            return Match([], 0)
        found = self.index.get(tuple(context[-KEY:]), [])[-MAX_CANDIDATES:]
        if not found:
            return Match([], 0)
        scored = [(self._matched(context, doc, end), doc, end) for doc, end in found]
        best = max(length for length, _, _ in scored)
        voters = [(doc, end) for length, doc, end in scored if length == best]
        drafts: list[int] = []
        alts: list[tuple[int, int]] = []
        while voters and len(drafts) < min(k, best):
            votes = Counter(self.docs[d][e] for d, e in voters if e < len(self.docs[d]))
            if not votes:
                break
            (token, count), *runner_up = votes.most_common(2)
            agreed = count > AGREE * len(voters)
            widen = bool(runner_up) and len(alts) < alternatives
            if not (agreed or widen):
                break
            if widen:
                alts.append((len(drafts), runner_up[0][0]))  # a sibling of this draft
            drafts.append(token)
            if not agreed:  # a split: both sides verified, nothing drafted past them
                break
            voters = [(d, e + 1) for d, e in voters if e < len(self.docs[d])]
            voters = [(d, e) for d, e in voters if self.docs[d][e - 1] == token]
        return Match(drafts, best, alts)

    def _matched(self, context: list[int], doc: int, end: int) -> int:
        tokens, n, limit = self.docs[doc], KEY, min(MAX_MATCH, end, len(context))
        while n < limit and tokens[end - n - 1] == context[-n - 1]:
            n += 1
        return n


def _mode(s: DraftState) -> str:
    """How to draft for `s`: its route's choice, else this drafter's own (suffix)."""
    return s.proposer or "suffix"


class SuffixProposer:
    """Drafts from the longer match of the request's own context and of its route's earlier
    responses; where neither matches `min_match` tokens, the draft model's proposal (or
    none without a model). `shared=False` keeps every request to its own context, as a
    route's `suffix_shared: false` keeps its requests (DraftState.suffix_private).

    A request's route may ask for another way (DraftState.proposer): `draft` (the model
    only), `ngram` (its own text only, as NgramProposer), `combined` (its own text, else
    the model, as CombinedProposer), so one drafter serves routes that draft differently."""

    def __init__(
        self,
        model: Proposer | None = None,
        min_match: int = 4,
        max_tokens: int = 1 << 20,
        shared: bool = True,
        alternatives: int = 0,
    ):
        self.model, self.min_match = model, min_match
        self.alternatives = alternatives  # runner-up leaves beside a shared match's drafts
        self.max_tokens, self.shared = max_tokens, shared
        self.routes: dict[str, ResponseIndex] = {}
        self._seen: dict[object, DraftState] = {}  # the last state of each open sequence
        self.shared_rounds = 0  # rounds drafted from earlier responses (a route's)
        # the request's own text, by the way its route drafts
        self.lookups = {
            "ngram": Lookups(4, 1),  # as NgramProposer's
            "combined": Lookups(COMBINED_MAX_N, COMBINED_MIN_MATCH),  # as CombinedProposer's
            "suffix": Lookups(COMBINED_MAX_N, min_match),
        }
        self._ahead = LookupAhead(self._look)

    @property
    def available(self) -> bool:
        return self.model is None or self.model.available

    @property
    def context_window(self) -> int:
        return getattr(self.model, "context_window", 0)

    def propose(self, states: list[DraftState]) -> list[Proposal]:
        found = []
        for s in states:
            self._seen[s.seq_id] = s
            proposal = self._look(s, commit=True)
            # nothing found: the model's turn, but a lookup-only route drafts nothing
            found.append(proposal or (Proposal() if _mode(s) == "ngram" else None))
        self._ahead.record((s, p) for s, p in zip(states, found, strict=True) if p is not None)
        return lookup_then_model(states, found, self.model)

    def _look(self, s: DraftState, commit: bool = False) -> Proposal | None:
        match = self._lookup(s, _mode(s), commit)
        return lookup(s, match.tokens, match.alts)

    def _lookup(self, s: DraftState, mode: str, commit: bool = False) -> Match:
        if mode == "draft":
            return Match([], 0)
        if mode in ("ngram", "combined"):
            return Match(self.lookups[mode].follow(s, commit), 0)
        match = self._match(s, commit)
        return match if match.length >= self.min_match else Match([], 0)

    def _match(self, s: DraftState, commit: bool = False) -> Match:
        """The longer of the own and the route's match (`commit`: `s`'s tokens are
        committed, a round asked: its own lookup indexed, a round drafted from the route's
        counted in shared_rounds)."""
        own = self.lookups["suffix"].follow(s, commit)
        own_match = Match(own, self.min_match if own else 0)
        index = self.routes.get(s.route) if self._shares(s) else None
        if index is None:
            return own_match
        theirs = index.continuation(s.tokens, s.k, self.alternatives)
        if len(theirs.tokens) > len(own) and theirs.length >= self.min_match:
            if commit:
                self.shared_rounds += 1
            return theirs
        return own_match

    def _shares(self, s: DraftState) -> bool:
        """Whether `s` drafts from, and adds to, its route's memory."""
        return self.shared and not s.suffix_private

    def draft_ahead(self, stop=lambda: False) -> list[tuple[DraftState, Proposal]]:
        """The lookup's rounds ahead (LookupAhead: the route's memory as the request's own
        text), beside the model's."""
        looked = self._ahead.draft()
        if self.model is not None and hasattr(self.model, "draft_ahead"):
            return self.model.draft_ahead(stop) + looked
        return looked

    def close(self, seq_id) -> None:
        """The sequence ended: its response joins its route's memory."""
        self._ahead.close(seq_id)
        for lookups in self.lookups.values():
            lookups.close(seq_id)
        s = self._seen.pop(seq_id, None)
        if s is not None and self._shares(s) and _mode(s) == "suffix":
            index = self.routes.setdefault(s.route, ResponseIndex(self.max_tokens))
            index.add(s.tokens[s.prompt_length :])
        if self.model is not None:
            self.model.close(seq_id)

    def forget_cached(self) -> None:
        """The draft model's cached prefixes; the routes' responses are kept (they are
        what the route drafts from, not a cache of computed K/V)."""
        if self.model is not None:
            self.model.forget_cached()
