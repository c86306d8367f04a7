"""A drafter's proposal over the wire (specd/wire.py): the round trip keeps tokens, sparse
q and alternatives; the verifier cuts to the k it asked for, and turns an error or a q
with NaN, inf or negative mass into an empty proposal instead of feeding it to the sampler."""

import math

import torch

from protos.specd.v1 import drafter_pb2
from specd.proposal import Proposal
from specd.wire_proposals import proposal_from_proto, proposal_to_proto


def sent(p: Proposal) -> drafter_pb2.SeqProposal:
    msg = drafter_pb2.SeqProposal(seq_id=3)
    proposal_to_proto(p, msg)
    return drafter_pb2.SeqProposal.FromString(msg.SerializeToString())


def test_round_trip_keeps_tokens_q_and_alternatives():
    ids = torch.tensor([[4, 9, 0], [7, 1, 2]])
    probs = torch.tensor([[0.5, 0.25, 0.25], [0.75, 0.125, 0.125]])
    p = Proposal(tokens=[4, 7], q_ids=ids, q_probs=probs, alts=[(0, 9), (1, 2)])
    back = proposal_from_proto(sent(p), k=2)
    assert back.tokens == [4, 7] and back.alts == [(0, 9), (1, 2)]
    assert torch.equal(back.q_ids, ids) and torch.equal(back.q_probs, probs)
    deterministic = proposal_from_proto(sent(Proposal(tokens=[1, 2, 3])), k=2)
    assert deterministic.tokens == [1, 2] and deterministic.q_ids is None
    assert not back.ngram and not deterministic.ngram


def test_an_ngram_continuation_says_so_on_the_wire_and_cut_to_k():
    back = proposal_from_proto(sent(Proposal(tokens=[8, 9, 5], ngram=True)), k=2)
    assert back.tokens == [8, 9] and back.ngram
    assert back.first(1).ngram and back.first(1).tokens == [8]


def test_errors_and_bad_q_become_empty_proposals():
    assert proposal_from_proto(None, k=4).tokens == []
    assert proposal_from_proto(drafter_pb2.SeqProposal(error="no session"), k=4).tokens == []
    for bad in (math.nan, math.inf, -0.5):
        p = Proposal(tokens=[4], q_ids=torch.tensor([[4, 5]]), q_probs=torch.tensor([[1.0, bad]]))
        assert proposal_from_proto(sent(p), k=4).tokens == []
