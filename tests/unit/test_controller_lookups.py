"""The controller pricing a step by its routes' share of rounds an n-gram lookup drafts
(the `combined` drafter tries a lookup in the request's text first): such a round runs no
draft model, so its step costs the forward and little more (docs/benchmarks-log.md
section 113)."""

import pytest

from specd.speculation_config import SpeculationConfig
from verifier_service.speculation.acceptance import expected_tokens
from verifier_service.speculation.controller import Controller
from verifier_service.speculation.step_shape import Candidate, Fixed

ACCEPT = [0.45]  # drafting by the model alone loses to plain at these prices
PLAIN_S = 0.040


def model_step_s(k: int) -> float:
    return 0.050 + 0.010 * k


def forward_s(rows: int) -> float:
    return 0.040 + 0.002 * rows


LOOKUP_REST_S = 0.004  # a lookup step less its forward: verification and commit


def priced() -> Controller:
    c = Controller(SpeculationConfig(explore_every=0))
    for _ in range(40):
        c.costs.record_step([0], PLAIN_S)
        for k in (1, 2, 3):
            c.costs.record_step([k], model_step_s(k))
    for rows in range(1, 5):
        c.costs.record_forward(rows, forward_s(rows))
    c.costs.record_lookup(1, forward_s(2) + LOOKUP_REST_S, forward_s(2))
    return c


@pytest.mark.parametrize("share", [0.3, 0.6, 0.9])
def test_a_step_is_priced_between_a_model_round_and_a_lookup_by_the_routes_share(share):
    c = priced()
    assert c.plan([Candidate(3, ACCEPT)]).ks == [0]  # the model's rounds alone: plain
    plan = c.plan([Candidate(3, ACCEPT, lookup=share)])
    rate = {
        k: expected_tokens(ACCEPT, k)
        / ((1 - share) * model_step_s(k) + share * (forward_s(1 + k) + LOOKUP_REST_S))
        for k in (1, 2, 3)
    }
    best = max(rate, key=rate.get)
    assert rate[best] > 1 / PLAIN_S and plan.ks == [best]
    assert plan.tokens / plan.seconds == pytest.approx(rate[best])


def test_beside_a_batch_that_drafts_by_the_model_no_step_is_priced_as_a_lookup():
    """The rest of the batch drafts at its fixed k: its rounds are not the candidates'
    route's, so the step runs the draft model whatever the candidates' share."""
    c = priced()
    fixed = Fixed.of([(ACCEPT, [], 2)])
    for share in (0.0, 1.0):
        assert c._step_s([Candidate(3, ACCEPT, lookup=share)], [2], fixed) == pytest.approx(
            c._step_s([Candidate(3, ACCEPT)], [2], fixed)
        )


def test_a_routes_share_is_learned_from_its_recent_rounds():
    c = Controller()
    assert c.lookups("code") == 0.0
    for i in range(40):
        c.record("code", 6, 3, drafted=6, lookup=i % 4 != 0)
        c.record("chat", 3, 1, drafted=3)
    assert c.lookups("code") == pytest.approx(30 / 42, abs=0.01)  # the prior: 2 rounds of none
    assert c.lookups("chat") == 0.0
    for _ in range(200):  # its text stops repeating: the share follows its last rounds
        c.record("code", 6, 3, drafted=6)
    assert c.lookups("code") < 0.05
