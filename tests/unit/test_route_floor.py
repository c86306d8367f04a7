"""A route's `min_acceptance` holds once its acceptance is known to be under it
(RouteAcceptance.upper, held against the floor by SpeculationControl's plan): one rejected
round on a route with nothing in memory (a fresh verifier, or minutes idle) does not turn
it off for the rest of the request, and a route measured under its floor is off."""

from __future__ import annotations

import random

import pytest

from specd.config import EngineConfig
from verifier_service.records import SeqView, StepView
from verifier_service.request import SpeculationBounds
from verifier_service.speculation import SpeculationControl
from verifier_service.speculation.route_acceptance import RouteAcceptance

PRIOR, STRENGTH = [0.7], 2.0
FLOOR = SpeculationBounds(auto=True, route="r", min_acceptance=0.5)


def _upper(routes: RouteAcceptance) -> float:
    return routes.upper("r", routes.estimate("r", PRIOR, STRENGTH)[0], STRENGTH)


def test_the_upper_bound_narrows_onto_the_estimate_as_rounds_come():
    routes = RouteAcceptance(clock=lambda: 0.0)
    routes.record("r", 4, 0)  # one round, every draft rejected
    assert routes.estimate("r", PRIOR, STRENGTH)[0] < 0.5 < _upper(routes)
    gaps = {}
    for n in range(2, 201):
        routes.record("r", 1, int(n % 10 < 3))  # a route that accepts 0.3
        estimate = routes.estimate("r", PRIOR, STRENGTH)[0]
        upper = _upper(routes)
        assert estimate < upper < 1.0
        gaps[n] = upper - estimate
    assert gaps[10] > gaps[30] > gaps[200]
    # the long memory holds 64 rounds: at 0.3 the bound is then under a floor of 0.5
    assert _upper(routes) < 0.5


def _control() -> SpeculationControl:
    """A control that measured plain and drafting steps of one sequence on a CPU-like
    device: a draft costs a fifth of a step, so drafting pays at an acceptance of 0.45."""
    control = SpeculationControl(EngineConfig(), clock=lambda: 0.0)
    for k in range(5):
        for _ in range(3):
            control.controller.costs.record_step([k], 0.040 + 0.008 * k)
    return control


def _decide(control: SpeculationControl) -> tuple[int, str]:
    view = StepView((SeqView(0, FLOOR, FLOOR.route, 4, 200, 0, 0),), 1, 0.1)
    decision = control.plan(view).decisions[0]
    return decision.k, decision.reason


@pytest.mark.parametrize("rounds", [1, 2])
def test_a_fresh_route_whose_first_rounds_failed_still_drafts_where_it_pays(rounds):
    control = _control()
    for _ in range(rounds):
        control.controller.record("r", 4, 0)
    assert control.controller.route_rates("r")[0] < FLOOR.min_acceptance  # the estimate
    k, reason = _decide(control)
    assert (k > 0, reason) == (True, "on")


def test_a_route_measured_under_its_floor_is_off_for_acceptance():
    control = _control()
    rnd = random.Random(1)
    for _ in range(40):
        control.controller.record("r", 1, int(rnd.random() < 0.2))
    assert _decide(control) == (0, "off:acceptance")
