"""A step's drafts: what the proposer offers for each decode slot, cut to what the plan
reserved (k drafts, `alts` leaves) and to what each grammar allows. A Round is one
sequence's part of the forward; nothing after this phase changes it."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from specd.models.seq_input import SeqInput
from specd.proposal import DraftState, Proposal, Proposer
from verifier_service.scheduler import Slot
from verifier_service.sequence import Sequence
from verifier_service.tree import tree_parents

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Round:
    slot: Slot
    proposal: Proposal | None = None  # None: prefill, plain decode, or no drafts came
    mask: torch.Tensor | None = None  # constrained: bool [nodes, V], the allowed tokens

    @property
    def seq(self) -> Sequence:
        return self.slot.seq

    @property
    def k(self) -> int:
        """Drafts verified this round."""
        return len(self.proposal.tokens) if self.proposal is not None else 0

    @property
    def num_logits(self) -> int:
        """Rows of logits it needs: every node of a decode round (root, chain,
        alternatives); one for the last chunk of a fresh prompt; else none."""
        if not self.slot.decode:
            return int(self.slot.logits)
        p = self.proposal
        return 1 + (len(p.tokens) + len(p.alts) if p is not None else 0)

    def seq_input(self) -> SeqInput:
        fed, p = list(self.slot.tokens), self.proposal
        if p is None:
            return SeqInput(self.slot.seq_id, fed, self.num_logits)
        alts = [t for _, t in p.alts]
        parents = tree_parents(len(fed), p) if alts else None
        return SeqInput(self.slot.seq_id, fed + p.tokens + alts, self.num_logits, parents)


def draft_rounds(slots: tuple[Slot, ...], proposer: Proposer | None, vocab: int) -> list[Round]:
    proposals = _propose([s for s in slots if s.decode and s.k > 0], proposer, vocab)
    rounds = []
    for slot in slots:
        proposal, mask, grammar = proposals.get(slot.seq_id), None, slot.seq.grammar
        if grammar is not None and (slot.decode or slot.logits):
            # cut to what the grammar allows (specd/grammar.py); masks for every node
            if proposal is None:
                mask = grammar.allowed()[None]
            else:
                proposal, mask = grammar.plan(proposal)
        rounds.append(Round(slot, proposal, mask))
    return rounds


def _propose(slots: list[Slot], proposer: Proposer | None, vocab: int) -> dict[int, Proposal]:
    if not slots or proposer is None:
        return {}
    states = [
        DraftState(s.seq_id, s.seq.tokens, s.seq.params, s.k, s.seq.span, s.seq.grammar)
        for s in slots
    ]
    try:
        proposals = proposer.propose(states)
    except Exception:  # a failed drafter costs speculation, never the request
        log.exception("drafter failed; decoding without drafts this round")
        return {}
    out = {}
    for slot, p in zip(slots, proposals, strict=True):
        # a remote drafter is another process: never feed the model an id it lacks
        bad = next((j for j, t in enumerate(p.tokens) if not 0 <= t < vocab), slot.k)
        p = p.first(min(slot.k, bad))
        alts = [(parent, t) for parent, t in p.alts if parent >= 0 and 0 <= t < vocab]
        out[slot.seq_id] = replace(p, alts=alts[: slot.alts])
    return out
