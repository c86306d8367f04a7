"""The step prices follow the machine's pace: a k not run for a while is priced at the
speed of now, not of when it last ran (verifier_service/speculation/costs.py, `StepCosts.pace`)."""

import math
import random

import pytest

from specd.speculation_config import SpeculationConfig
from verifier_service.speculation.controller import Controller
from verifier_service.speculation.costs import StepCosts
from verifier_service.speculation.step_shape import Candidate

CODE_ACCEPT = [0.87, 0.8, 0.75, 0.7, 0.65, 0.6]


def learned(costs: StepCosts, prices: dict[int, float], batch: int = 4, times: int = 40) -> None:
    for _ in range(times):
        for k, seconds in prices.items():
            costs.record(batch, k, seconds)


def test_a_k_not_run_is_priced_at_the_pace_of_now():
    costs = StepCosts()
    learned(costs, {0: 0.040, 1: 0.080})
    assert costs(4, 0) == pytest.approx(0.040) and costs(4, 1) == pytest.approx(0.080)
    for _ in range(4):  # plain alone for a while (a slowdown at the very step where
        costs.record(4, 0, 0.040)  # the regimes change would set them apart: below)
    for _ in range(40):  # the host slows by a quarter; only plain runs
        costs.record(4, 0, 0.050)
    assert costs(4, 0) == pytest.approx(0.050, rel=0.02)
    # k = 1 slowed with it: most of the quarter (the rest went to plain's own price, as
    # the pace cannot tell the machine from a price at first)
    assert 0.080 * 1.2 < costs(4, 1) < 0.100
    assert 1.2 < costs.pace < 1.25
    for _ in range(4):  # k = 1 runs, slowed as plain was...
        costs.record(4, 1, 0.100)
    for _ in range(40):  # ...and the host speeds up again
        costs.record(4, 1, 0.080)
    assert costs(4, 0) < 0.040 * 1.08
    assert costs.measured()[(4, 1)] == pytest.approx(0.080, rel=0.02)


def test_a_k_measured_a_few_times_learns_its_price_and_leaves_the_pace():
    costs = StepCosts()
    learned(costs, {0: 0.040})
    for _ in range(30):  # new, and dearer than its first steps said: their median, whole
        costs.record(4, 3, 0.150)
    for _ in range(3):
        costs.record(4, 3, 0.180)
    assert costs.pace == 1.0
    assert costs(4, 3) == pytest.approx(0.150)
    costs.record(4, 0, 0.040 * 100)  # one stalled step moves the pace by 1%, no more
    assert costs.pace == pytest.approx(math.exp(0.2 * 0.05))


def test_a_stall_while_a_k_learns_its_price_does_not_set_it():
    """Batch 2 at k = 3, the first steps of a verifier (docs/benchmarks-log.md section 62): two
    stalled steps (347 and 525 ms) among steps of ~100 ms. Their mean learned 138 ms,
    which the settled price then kept for hundreds of steps (a settled step moves it by a
    clipped ~0.1%), and k = 3 was priced ~20% dearer against k = 6 than its steps ran.
    The median of the steps learned is their price."""
    costs = StepCosts()
    steps = [0.068, 0.117, 0.096, 0.099, 0.095, 0.085, 0.069, 0.109, 0.104, 0.100, 0.120]
    steps += [0.099, 0.091, 0.347, 0.525] + [0.100, 0.098, 0.102] * 6 + [0.101]
    for seconds in steps:
        costs.record(2, 3, seconds)
    assert costs.samples(2, 3) == len(steps) >= 1 / costs.weight  # settled from here on
    assert costs(2, 3) == pytest.approx(0.100, rel=0.02)
    before = costs(2, 3)
    for _ in range(5):  # settled: what a stall moves is the pace, by 1% a step at most
        costs.record(2, 3, 0.500)
    assert costs(2, 3) < before * 1.06


@pytest.mark.parametrize("seed", range(5))
def test_one_k_run_for_long_leaves_the_others_priced_as_they_were(seed):
    """Step times spread (batch 2 at k = 3: a log spread of ~0.18). The pace settled at
    their geometric mean and the running k's price at their arithmetic mean, so the two
    pulled apart for as long as k = 3 ran, and k = 5, priced by the pace, fell to a third
    of its price against k = 3's in 3000 steps."""
    rng = random.Random(seed)
    costs = StepCosts()

    def step(k: int, seconds: float) -> None:
        costs.record(2, k, seconds * math.exp(rng.gauss(0.0, 0.2)))

    for _ in range(40):
        step(5, 0.140)
        step(3, 0.105)
    before = costs(2, 5) / costs(2, 3)
    for _ in range(3000):
        step(3, 0.105)
    assert costs(2, 5) / costs(2, 3) == pytest.approx(before, rel=0.05)
    assert 0.8 < costs.pace < 1.25


def test_a_stalled_second_does_not_price_the_k_learned_after_it():
    """Batch 2 on the 2-core CPU (round 52's step log): k = 3 at 108 ms, then six steps
    at 1.2-2.1x as the forward stalled at a cell's end, then a cell of k = 6 (188 ms) with
    no settled k to move the pace. k = 6 learns its price at the pace of then: moved by
    the stall in full, that priced k = 6 at 1.24x k = 3, under the 1.43 where k = 3's
    6.4 tokens a step make more than k = 6's 9.2, and `auto` drafted 6 where 3 was ~15%
    faster. Clipped, the stall moves the pace by 6% at most, and k = 6 is priced at ~1.57x."""
    rng = random.Random(0)
    costs = StepCosts()
    for _ in range(60):
        costs.record(2, 3, 0.108 * math.exp(rng.gauss(0.0, 0.08)))
    before = costs.pace
    for ratio in (1.35, 1.05, 1.39, 1.24, 2.14, 1.16):
        costs.record(2, 3, 0.108 * ratio)
    assert costs.pace / before < math.exp(6 * 0.2 * 0.05) + 1e-9  # six steps, 1% each
    for _ in range(60):
        costs.record(2, 6, 0.188 * math.exp(rng.gauss(0.0, 0.08)))
    assert costs(2, 6) / costs(2, 3) > 1.55


def test_a_slow_minute_does_not_start_drafting_where_plain_is_faster():
    """Batch 4 on the 2-core CPU: plain 40 ms (100 tok/s), k = 1 80 ms (93.5 tok/s at
    0.87). The host then slows plain to 50 ms: priced at the speed of its last run, k = 1
    looked 17% faster than plain and `auto` drafted; priced at the pace of now, it stays
    6% behind."""

    def plans(pace_weight: float) -> list[int]:
        c = Controller(SpeculationConfig(explore_every=0))
        c.costs.steps = StepCosts(SpeculationConfig(pace_weight=pace_weight))
        learned(c.costs.steps, {0: 0.040, 1: 0.080})
        for _ in range(200):  # where the pace does not move, plain's own price follows
            c.costs.record_step([0] * 4, 0.050)
        return c.plan([Candidate(6, CODE_ACCEPT)] * 4).ks

    assert plans(0.2) == [0] * 4
    assert plans(0.0) == [1] * 4  # the stale price (pace never moves) drafts
