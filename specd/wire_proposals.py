"""The drafter's proposals (tokens, sparse draft probabilities, alternatives) to and from
protobuf; a malformed answer from the other process becomes an empty proposal."""

from __future__ import annotations

import logging

import torch

from protos.specd.v1 import drafter_pb2
from specd.proposal import Proposal

log = logging.getLogger(__name__)


def proposal_to_proto(p: Proposal, msg: drafter_pb2.SeqProposal) -> None:
    """Fill a drafter's answer for one sequence: tokens, sparse q, alternatives, and
    whether the tokens are an n-gram continuation."""
    msg.tokens.extend(p.tokens)
    msg.ngram = p.ngram
    if p.q_ids is not None:
        for ids, probs in zip(p.q_ids.tolist(), p.q_probs.tolist(), strict=True):
            msg.q.add(ids=ids, probs=probs)
    for parent, token in p.alts:
        msg.alternatives.add(parent=parent, token=token)


def proposal_from_proto(msg: drafter_pb2.SeqProposal | None, k: int) -> Proposal:
    """A drafter's answer -> at most k drafts; an empty proposal for an error, or for a q
    with NaN, inf or negative mass (another process's numbers never reach the sampler
    unchecked)."""
    if msg is None or msg.error:
        return Proposal()
    tokens = list(msg.tokens)[:k]
    alts = [(a.parent, a.token) for a in msg.alternatives]
    if not msg.q or len(msg.q) < len(tokens):
        return Proposal(tokens=tokens, alts=alts, ngram=msg.ngram)
    m = max(len(q.ids) for q in msg.q[: len(tokens)])
    ids = torch.zeros(len(tokens), m, dtype=torch.long)
    probs = torch.zeros(len(tokens), m)
    for j, q in enumerate(msg.q[: len(tokens)]):
        ids[j, : len(q.ids)] = torch.tensor(list(q.ids))
        probs[j, : len(q.probs)] = torch.tensor(list(q.probs))
    if not torch.isfinite(probs).all() or (probs < 0).any():
        log.warning("drafter sent a q with NaN, inf or negative mass; round dropped")
        return Proposal()
    return Proposal(tokens=tokens, q_ids=ids, q_probs=probs, alts=alts, ngram=msg.ngram)
