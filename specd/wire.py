"""Conversions between protobuf messages and specd's own types (done at the edges).

Torch-free at import (the router uses this module): the proposal conversions, which the
router never calls, import torch when they run.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from protos.specd.v1 import common_pb2, drafter_pb2
from specd.constraint import Constraint
from specd.params import SamplingParams

if TYPE_CHECKING:
    from specd.proposal import Proposal

log = logging.getLogger(__name__)


def params_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Proto3 zeros mean "unset": top_p 0 -> 1 (off); repetition_penalty unset -> 1."""
    return SamplingParams(
        temperature=msg.temperature,
        top_k=msg.top_k,
        top_p=msg.top_p if msg.top_p != 0 else 1.0,
        min_p=msg.min_p,
        repetition_penalty=msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0,
        seed=msg.seed if msg.HasField("seed") else None,
    )


def params_to_proto(p: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p
    )
    if p.repetition_penalty != 1.0:
        msg.repetition_penalty = p.repetition_penalty
    if p.seed is not None:
        msg.seed = p.seed
    return msg


def speculation_to_proto(stats, k: int) -> common_pb2.SpeculationInfo:
    """A request's speculation totals (verifier_service.sequence.SpecStats) as sent."""
    return common_pb2.SpeculationInfo(
        enabled=stats.rounds > 0,
        reason=stats.reason,
        num_draft_tokens=k,
        rounds=stats.rounds,
        drafted=stats.drafted,
        accepted=stats.accepted,
        acceptance_rate=stats.acceptance_rate,
        mean_accepted_length=stats.mean_accepted_length,
        mean_draft_tokens=stats.drafted / stats.rounds if stats.rounds else 0.0,
    )


def constraint_from_proto(msg: common_pb2.Constraint) -> Constraint | None:
    """Unset -> None. Only the kind is checked here; Constraint.grammar() checks the rest."""
    kind = msg.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "json_object":
        if not msg.json_object:
            raise ValueError("constraint.json_object must be true when set")
        return Constraint("json_object")
    return Constraint(kind, getattr(msg, kind))


def constraint_to_proto(c: Constraint | None) -> common_pb2.Constraint:
    if c is None:
        return common_pb2.Constraint()
    if c.kind == "json_object":
        return common_pb2.Constraint(json_object=True)
    return common_pb2.Constraint(**{c.kind: c.text})


def proposal_to_proto(p: Proposal, msg: drafter_pb2.SeqProposal) -> None:
    """Fill a drafter's answer for one sequence: tokens, sparse q, alternatives."""
    msg.tokens.extend(p.tokens)
    if p.q_ids is not None:
        for ids, probs in zip(p.q_ids.tolist(), p.q_probs.tolist(), strict=True):
            msg.q.add(ids=ids, probs=probs)
    for parent, token in p.alts:
        msg.alternatives.add(parent=parent, token=token)


def proposal_from_proto(msg: drafter_pb2.SeqProposal | None, k: int) -> Proposal:
    """A drafter's answer -> at most k drafts; an empty proposal for an error, or for a q
    with NaN, inf or negative mass (another process's numbers never reach the sampler
    unchecked)."""
    import torch

    from specd.proposal import Proposal

    if msg is None or msg.error:
        return Proposal()
    tokens = list(msg.tokens)[:k]
    alts = [(a.parent, a.token) for a in msg.alternatives]
    if not msg.q or len(msg.q) < len(tokens):
        return Proposal(tokens=tokens, alts=alts)
    m = max(len(q.ids) for q in msg.q[: len(tokens)])
    ids = torch.zeros(len(tokens), m, dtype=torch.long)
    probs = torch.zeros(len(tokens), m)
    for j, q in enumerate(msg.q[: len(tokens)]):
        ids[j, : len(q.ids)] = torch.tensor(list(q.ids))
        probs[j, : len(q.probs)] = torch.tensor(list(q.probs))
    if not torch.isfinite(probs).all() or (probs < 0).any():
        log.warning("drafter sent a q with NaN, inf or negative mass; round dropped")
        return Proposal()
    return Proposal(tokens=tokens, q_ids=ids, q_probs=probs, alts=alts)
