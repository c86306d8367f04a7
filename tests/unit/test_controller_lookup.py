"""Steps whose every round is an n-gram lookup, priced apart (verifier_service/controller.py,
verifier_service/costs.py): no draft model runs, so such a step costs about a plain step
with more rows, and a route that drafts by lookup half of the time is priced so."""

import pytest

from verifier_service.acceptance import PositionAcceptance, expected_tokens
from verifier_service.controller import LOOKUP_PRIOR, LOOKUP_ROUNDS, Controller
from verifier_service.step_shape import Candidate, Fixed

# retrieval answers at c = 1 (BENCHMARKS.md section 61): the route's a_i, and the prices
# the controller held at batch 1 for plain steps and the model's rounds of 3 and 4 drafts,
# and what lookup steps of 3 and 4 drafts took
RETRIEVAL = [0.92, 0.89, 0.92, 0.87]
PLAIN_S, MODEL_S, LOOKUP_S = 0.055, {3: 0.100, 4: 0.125}, {3: 0.058, 4: 0.060}


def measured() -> Controller:
    c = Controller()
    for _ in range(40):
        c.costs.record_step([0], PLAIN_S)
        for k in (3, 4):
            c.costs.record_step([k], MODEL_S[k])
            c.costs.record_lookup_step([k], LOOKUP_S[k])
    return c


def test_a_route_that_drafts_by_lookup_is_priced_by_its_lookup_steps():
    """Priced as the model's rounds, k = 3 makes 34.9 tokens/s against k = 4's 33.2; with
    60% of the rounds lookups, k = 3 makes 46.7 and k = 4 48.2. The plan follows."""
    c = measured()
    assert c.costs.lookup_s(1, 3) == pytest.approx(LOOKUP_S[3])
    assert c.costs.lookup_s(1, 2) == pytest.approx(LOOKUP_S[3])  # under the least: flat
    assert c.costs.lookup_s(2, 3) is None  # a batch size never measured so: unknown
    assert c.plan([Candidate(4, RETRIEVAL)]).ks == [3]
    assert c.plan([Candidate(4, RETRIEVAL, lookup=0.6)]).ks == [4]
    rates = c._rates([Candidate(4, RETRIEVAL, lookup=0.6)], Fixed())
    for k in (3, 4):
        seconds = 0.6 * LOOKUP_S[k] + 0.4 * MODEL_S[k]
        assert rates[k] == pytest.approx(expected_tokens(RETRIEVAL, k) / seconds)


def test_a_step_is_a_lookup_only_where_every_round_is_one():
    """Two sequences each drafting by lookup half of the time: a step of both is all
    lookups a quarter of the time. Where the rest of the batch drafts (its routes unknown
    to the plan), or no lookup step of the batch size was measured, the model's price."""
    c = measured()
    for _ in range(40):
        c.costs.record_step([3, 3], 0.150)
        c.costs.record_lookup_step([3, 3], 0.080)
    pair = [Candidate(3, RETRIEVAL, lookup=0.5)] * 2
    assert c._step_s(pair, [3, 3], Fixed()) == pytest.approx(0.25 * 0.080 + 0.75 * 0.150)
    assert c._step_s(pair, [3, 0], Fixed()) == pytest.approx(0.5 * 0.080 + 0.5 * 0.150)
    beside = Fixed(sequences=1, rows=4, tokens=3.0, k=3)
    assert c._step_s(pair[:1], [3], beside) == pytest.approx(0.150)
    three = [Candidate(3, RETRIEVAL, lookup=1.0)] * 3
    assert c._step_s(three, [3, 3, 3], Fixed()) == c.costs(3, 3, 12, 3)


def test_lookup_prices_follow_the_machine_as_the_model_steps_do():
    """Lookup steps are held at the pace of the model's steps: where the host slows by a
    quarter, they are priced dearer as the pace follows, before any lookup runs again."""
    c = measured()
    before = c.costs.lookup_s(1, 4)
    for _ in range(200):
        c.costs.record_step([4], 1.25 * MODEL_S[4])
    pace = c.costs.steps.pace
    assert pace > 1.15
    assert c.costs.lookup_s(1, 4) == pytest.approx(pace * before)
    c.costs.record_lookup_step([4], pace * LOOKUP_S[4])  # one as dear as the pace says
    assert c.costs.lookup_s(1, 4) == pytest.approx(pace * before)


def test_a_routes_lookup_share_counts_its_recent_rounds():
    c = Controller()
    seq = PositionAcceptance()
    assert c.lookup_share("rag") == 0.0  # before any round: priced as the model's
    for _ in range(200):
        c.record("rag", seq, 4, 4, 4, lookup=True)
        c.record("code", seq, 6, 5, 6)
        c.record("code", seq, 0, 0)  # plain steps are no rounds
    assert c.lookup_share("rag") == pytest.approx(LOOKUP_ROUNDS / (LOOKUP_ROUNDS + LOOKUP_PRIOR))
    assert c.lookup_share("code") == 0.0
    for _ in range(200):  # the text stopped repeating: the share fades with the rounds
        c.record("rag", seq, 4, 1, 4)
    assert c.lookup_share("rag") < 0.05
    c.record("rag", seq, 4, 0, 0, lookup=False)  # a round where nothing came counts nothing
    assert c._lookups["rag"][1] == pytest.approx(LOOKUP_ROUNDS)


def test_a_model_round_after_a_lookup_round_prices_the_lookup_not_its_depth():
    """After a lookup round the draft model catches up on what the lookup accepted (~30 ms
    at batch 1). That step's extra over its depth's price is what a lookup adds later: the
    depth keeps its price, and a sequence drafting by lookup half of the time pays it a
    quarter of its steps (a model round after a lookup one)."""
    c = measured()
    for _ in range(20):
        c.costs.record_step([4], MODEL_S[4] + 0.030, after_lookup=True)
    assert c.costs.after_lookup_s(1) == pytest.approx(0.030)
    assert c.costs.steps(1, 4) == pytest.approx(MODEL_S[4])
    assert c.costs.after_lookup_s(2) == pytest.approx(0.030)  # flat past the measured
    half = [Candidate(4, RETRIEVAL, lookup=0.5)]
    price = 0.5 * LOOKUP_S[4] + 0.5 * MODEL_S[4] + 0.25 * 0.030
    assert c._step_s(half, [4], Fixed()) == pytest.approx(price)
    assert c._step_s([Candidate(4, RETRIEVAL)], [4], Fixed()) == pytest.approx(MODEL_S[4])
    assert c.plan(half).ks == [4]
