"""A client's predicted output as drafts (specd/prediction.py): where they come from, and
that the engine's output is the same with any prediction as without one."""

import pytest

from specd.prediction import Prediction
from specd.proposal import Proposal
from tests.conftest import run_engine
from tests.unit.test_engine import PROMPTS, make_engine
from verifier_service.request import Request
from verifier_service.sequence import Sequence


def drafts(prediction: Prediction, output: list[int], k: int = 3) -> list[int]:
    prompt = [900, 901]  # the output's tokens follow the prompt's
    return prediction.drafts(prompt + output, len(prompt), k)


def test_the_drafts_follow_the_output_along_the_prediction():
    p = Prediction([1, 2, 3, 4, 5, 6])
    assert drafts(p, []) == [1, 2, 3]  # the first tokens, before any output
    assert drafts(p, [1, 2]) == [3, 4, 5]
    assert drafts(p, [1, 2, 3, 4, 5], k=4) == [6]  # no more than it holds
    assert drafts(p, [1, 2, 3, 4, 5, 6]) == []


def test_after_an_edit_the_drafts_resume_where_the_output_meets_the_prediction_again():
    p = Prediction([10, 11, 12, 13, 14, 15, 16, 17])
    assert drafts(p, [10, 11, 99]) == []  # left it, and [11, 99] is nowhere in it
    assert drafts(p, [10, 11, 99, 98, 13]) == []  # one token is not enough to find it
    assert drafts(p, [10, 11, 99, 98, 13, 14]) == [15, 16, 17]  # found by [13, 14]
    assert drafts(p, [10, 11, 99, 98, 13, 14, 15, 16]) == [17]  # followed on


def test_the_longest_match_wins_then_the_first_after_where_the_output_left():
    p = Prediction([4, 5, 6, 0, 3, 5, 6, 1])
    assert drafts(p, [9, 3, 5, 6], k=1) == [1]  # [3, 5, 6] beats the nearer [5, 6]
    q = Prediction([0, 1, 2, 5, 6, 3, 4, 8, 8, 5, 6, 7, 8, 5, 6, 9])
    assert drafts(q, [0, 1, 2, 5, 6, 3, 42, 5, 6], k=1) == [7]  # the first after it left
    r = Prediction([5, 6, 0, 1, 2, 3, 4])
    assert drafts(r, [5, 6, 0, 1, 2, 3, 42, 5, 6], k=1) == [0]  # none after: the last before


def test_an_output_it_did_not_follow_starts_it_over():
    p = Prediction([1, 2, 3, 4])
    assert drafts(p, [1, 2, 3]) == [4]
    assert drafts(p, [1]) == [2, 3, 4]


@pytest.mark.parametrize("mangle", ["exact", "edited", "unrelated"])
def test_greedy_output_is_the_same_with_a_prediction_as_without(tiny_pair, mangle):
    """A prediction drafts without a drafter, up to the engine's max k (here 6, though
    the request asks for 2), and never changes the output."""
    reqs = [dict(prompt=p, max_new_tokens=30) for p in PROMPTS]
    off = list(run_engine(make_engine(tiny_pair), reqs).values())
    predicted = {
        "exact": off,
        "edited": [out[:5] + [7, 7, 7] + out[9:20] + out[22:] for out in off],
        "unrelated": [[(t * 7 + 3) % 50 for t in out] for out in off],
    }[mangle]
    engine = make_engine(tiny_pair, max_draft_tokens=6)  # no proposer: the prediction drafts
    asked = [
        dict(r, num_draft=2, prediction=tuple(p)) for r, p in zip(reqs, predicted, strict=True)
    ]
    ids = [engine.add_request(Request(**r)) for r in asked]
    stats, got = {}, {i: [] for i in ids}
    while engine.has_work():
        for o in engine.step():
            got[o.seq_id] += o.tokens
            stats[o.seq_id] = o.stats
    assert [got[i] for i in ids] == off
    assert engine.kv.allocator.num_used == 0
    drafted = sum(s.predicted_drafted for s in stats.values())
    accepted = sum(s.predicted_accepted for s in stats.values())
    assert drafted == sum(s.drafted for s in stats.values())  # every draft was predicted
    if mangle == "exact":
        assert accepted == drafted > 0
        assert max(s.drafted / s.rounds for s in stats.values()) > 2  # past the asked k
    elif mangle == "edited":
        assert 0 < accepted < drafted
    if drafted:  # its acceptance is learnt apart from the route's requests without one
        assert set(engine.acceptance_by_route()) == {"default+prediction"}


class FixedDrafts:
    """A drafter that drafts token 3, k times, whatever the sequence."""

    available = True
    most = 0  # the largest k it was asked for

    def propose(self, states):
        self.most = max([self.most] + [s.k for s in states])
        return [Proposal(tokens=[3] * s.k) for s in states]

    def close(self, seq_id) -> None:
        pass

    def forget_cached(self) -> None:
        pass


def test_where_the_output_leaves_the_prediction_the_drafter_drafts_learnt_as_the_routes(
    tiny_pair,
):
    reqs = [dict(prompt=p, max_new_tokens=30) for p in PROMPTS]
    off = list(run_engine(make_engine(tiny_pair), reqs).values())
    engine = make_engine(tiny_pair)
    engine.proposer = FixedDrafts()
    edited = [out[:5] + [7, 7, 7] + out[9:] for out in off]
    asked = [dict(r, num_draft=2, prediction=tuple(p)) for r, p in zip(reqs, edited, strict=True)]
    ids = [engine.add_request(Request(**r)) for r in asked]
    got = {i: [] for i in ids}
    while engine.has_work():
        for o in engine.step():
            got[o.seq_id] += o.tokens
    assert [got[i] for i in ids] == off
    totals = engine.totals
    assert 0 < totals.predicted_drafted < totals.drafted  # the drafter's rounds beside
    assert engine.proposer.most == 2  # the k asked: only a prediction's rounds take more
    assert set(engine.acceptance_by_route()) == {"default", "default+prediction"}


def test_a_sequence_plans_at_its_predictions_acceptance_while_it_follows_it():
    seq = Sequence.start(0, Request([1, 2], prediction=(5, 6, 7)), eos_ids=set())
    seq.append([5])
    assert seq.acceptance_key == "default+prediction"
    seq.append([9])  # left it
    assert seq.acceptance_key == "default"
    seq.append([5, 6])  # found again, 7 to come
    assert seq.acceptance_key == "default+prediction"
    seq.append([7])  # nothing left of it to draft
    assert seq.acceptance_key == "default"
