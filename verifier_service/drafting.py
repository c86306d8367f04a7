"""A step's drafts: what the proposer offers for each decode slot, cut to what the plan
reserved (k drafts, `alts` leaves) and to what each grammar allows, as one `Round`
(verifier_service/records.py) a sequence; nothing after this phase changes them."""

from __future__ import annotations

import logging
from dataclasses import replace

from specd.proposal import DraftState, Proposal, Proposer
from verifier_service.records import Round, Slot

log = logging.getLogger(__name__)


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


def draft_state(slot: Slot) -> DraftState:
    """What the proposer is told of a slot's sequence: its committed tokens, k, and how to
    draft for it."""
    seq, speculation = slot.seq, slot.seq.speculation
    return DraftState(
        slot.seq_id, seq.tokens, seq.params, slot.k, seq.span, seq.grammar, speculation.route,
        len(seq.prompt), speculation.proposer, speculation.suffix_private, seq.cache_salt,
    )  # fmt: skip


def _propose(slots: list[Slot], proposer: Proposer | None, vocab: int) -> dict[int, Proposal]:
    """Each slot's drafts: its predicted output's where the output follows it, else the
    proposer's (one call for the rest)."""
    out = {}
    for slot in slots:
        prediction = slot.seq.prediction
        if prediction is not None and (
            tokens := prediction.drafts(slot.seq.tokens, len(slot.seq.prompt), slot.k)
        ):
            out[slot.seq_id] = Proposal(tokens=tokens, ngram=True, predicted=True)
    slots = [s for s in slots if s.seq_id not in out]
    if not slots or proposer is None:
        return out
    states = [draft_state(s) for s in slots]
    try:
        proposals = proposer.propose(states)
    except Exception:  # a failed drafter costs speculation, never the request
        log.exception("drafter failed; decoding without drafts this round")
        return out
    for slot, p in zip(slots, proposals, strict=True):
        # a remote drafter is another process: never feed the model an id it lacks
        bad = next((j for j, t in enumerate(p.tokens) if not 0 <= t < vocab), slot.k)
        p = p.first(min(slot.k, bad))
        alts = [(parent, t) for parent, t in p.alts if parent >= 0 and 0 <= t < vocab]
        out[slot.seq_id] = replace(p, alts=alts[: slot.alts])
    return out
