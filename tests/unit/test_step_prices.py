"""What a decode step is priced at: whole steps by (sequences, k), a drafting one's
forward by rows apart, each k's own price or the line's through its neighbours, and the
plans those prices make (verifier_service/speculation/costs.py)."""

import math
import random

import pytest

from specd.speculation_config import SpeculationConfig
from tests.unit.test_controller_steps import AVX2_STEP_S, CODE_ACCEPT, best_k
from verifier_service.speculation.controller import Controller
from verifier_service.speculation.costs import StepCosts
from verifier_service.speculation.step_shape import Candidate


def test_step_costs_average_and_follow_a_line_in_k_from_the_smallest_measured():
    steps = StepCosts(SpeculationConfig(step_weight=0.5))
    assert steps(2, 3) is None and steps.samples(2, 3) == 0
    steps.record(2, 0, 0.05)
    steps.record(2, 1, 0.1)
    steps.record(2, 5, 0.3)
    assert steps(2, 3) == pytest.approx(0.2)  # between two measured k of the same batch
    assert steps(2, 6) == pytest.approx(0.35)  # past the largest: on along the line
    assert steps(3, 3) is None and steps(2, 0) == 0.05  # another batch size: unknown
    steps.record(2, 4, 0.3)
    steps.record(1, 0, 0.05)
    assert steps(1, 2) is None  # never between plain and a drafting k: not linear
    steps.record(4, 0, 0.09)
    assert steps(3, 0) == pytest.approx(0.07)  # plain: between measured batch sizes
    steps.record(2, 1, 0.2)  # the second event replaces the first (which may run cold)
    assert steps.measured()[(2, 1)] == pytest.approx(0.2) and steps.samples(2, 1) == 2
    steps.record(2, 1, 0.1)  # an EMA from the third, with its count...
    assert steps.measured()[(2, 1)] == pytest.approx(0.15) and steps.samples(2, 1) == 3
    # ...and the price the least-squares line through k = 1 (3 times), 4 and 5 gives it
    assert steps(2, 1) == pytest.approx(0.1520, abs=1e-4)
    steps.record(2, 2, 0.0)  # nonsense timings are ignored
    assert steps.samples(2, 2) == 0


def knee_forward_s(rows: float) -> float:
    """The int4 1.5B's forward on the 2-core Zen 5 by rows: flat to 8 (its kernel's block
    of rows), then ~6.5 ms a row (docs/benchmarks-log.md section 97)."""
    return 0.033 + 0.0065 * max(0.0, rows - 8)


def test_a_drafting_step_is_priced_at_the_rows_its_forward_feeds():
    """Batch 2, deepest round 4: the other sequence's drafter stopped 2 short in half the
    steps (8 rows, under the knee) and not in the rest (10 rows). A price by (sequences,
    k) alone is their mean at any rows; the forward part follows the rows."""
    steps = StepCosts(SpeculationConfig(pace_weight=0.0))
    rest_s = 0.030  # the drafter round, verification and commit
    for _ in range(40):
        for rows in (8, 10):
            steps.record(2, 4, rest_s + knee_forward_s(rows), rows, knee_forward_s(rows))
    for rows in (8, 9, 10):
        assert steps(2, 4, rows) == pytest.approx(rest_s + knee_forward_s(rows), rel=1e-3)
    assert steps.measured()[(2, 4)] == pytest.approx(rest_s)  # the rest, held apart


def test_a_settled_drafting_step_moves_the_pace_by_its_whole_and_each_part_by_its_own():
    steps = StepCosts()
    for _ in range(40):
        steps.record(2, 3, 0.030 + 0.033, 8, 0.033)
    assert steps.pace == 1.0 and steps(2, 3, 8) == pytest.approx(0.063)
    steps.record(2, 3, 100 * 0.063, 8, 0.033)  # a stall outside the forward: one step...
    assert steps.pace == pytest.approx(math.exp(0.2 * 0.05))  # ...moves the pace 1%, no more
    # the forward ran at its price: what the pace moved is taken back from it, in its
    # weight's measure; the rest moved by what was left of its clipped distance
    assert steps(2, 3, 8) - steps.measured()[(2, 3)] == pytest.approx(
        0.033 * math.exp(0.2 * 0.05) ** (1 - 0.03), rel=1e-6
    )
    assert 0.030 < steps.measured()[(2, 3)] < 0.030 * math.exp(0.05)


def test_at_batch_2_the_forwards_knee_keeps_rounds_at_3():
    """Section 97's code c = 2: the forward is flat to 8 rows, so two rounds of 3 ride in
    one block, and a fourth draft a sequence buys less than half a token for a second
    block. The forward by rows, learned at any batch size, prices k = 3 where only k = 2
    and k = 6 ran at batch 2 (their rests on a line in k); a line through those two whole
    steps would not see the knee (k = 3 and k = 4 priced within 0.1% of each other)."""
    accept = CODE_ACCEPT

    def rest_s(k):
        return 0.030 + 0.001 * k

    c = Controller(SpeculationConfig(explore_every=0))
    # (batch, k) that ran: their rows 7, 8, 9 at batch 1, 4 and 3, and 6 and 14 at batch 2
    for sequences, k in ((1, 6), (4, 1), (3, 2), (2, 2), (2, 6)):
        rows = sequences * (1 + k)
        for _ in range(8):
            forward_s = knee_forward_s(rows)
            c.costs.record_step(
                [k] * sequences, rest_s(k) + forward_s, rows=rows, forward_s=forward_s
            )
        c.costs.record_step([0] * sequences, knee_forward_s(sequences) + 0.002)

    def true_s(k):
        return rest_s(k) + knee_forward_s(2 * (1 + k)) if k else knee_forward_s(2) + 0.002

    assert best_k(true_s, accept, 6) == 3
    assert c.plan([Candidate(6, accept)] * 2).ks == [3, 3]


def test_a_step_cost_that_varies_by_round_settles_on_its_mean():
    """Steps planned at k = 6 whose drafter stops short cost 65-160 ms by where it
    stopped: the price starts as the mean of the samples since the second (no slow start)
    and then moves by the EMA's small weight, in the logarithm once settled, each step
    counted at most 0.05 from the price (as the pace does, test_controller_pace.py). It
    settles where as many steps run over as under (here the median of the five, 6% over
    their geometric mean) and holds within a band of ~6%, where a weight of 0.3 wanders
    over ~36% (the price held: the machine's pace apart, which such steps of one k alone
    would move)."""
    steps = StepCosts(SpeculationConfig(pace_weight=0.0))
    steps.record(1, 6, 0.5)  # a cold first step: replaced by the second
    steps.record(1, 6, 0.07)
    steps.record(1, 6, 0.16)
    assert steps(1, 6) == pytest.approx(0.115)
    rnd = random.Random(0)
    mix = [rnd.choice([0.065, 0.09, 0.11, 0.13, 0.16]) for _ in range(600)]
    mean = math.exp(sum(math.log(s) for s in mix[100:]) / len(mix[100:]))
    smooth, noisy = (
        StepCosts(SpeculationConfig(pace_weight=0.0)),
        StepCosts(SpeculationConfig(step_weight=0.3, pace_weight=0.0)),
    )
    prices = {id(smooth): [], id(noisy): []}
    for i, seconds in enumerate(mix):
        for costs in (smooth, noisy):
            costs.record(1, 6, seconds)
            if i >= 100:
                prices[id(costs)].append(costs(1, 6))
    held = prices[id(smooth)]
    assert max(abs(p / mean - 1) for p in held) < 0.12
    assert max(held) / min(held) < 1.07
    assert max(prices[id(noisy)]) / min(prices[id(noisy)]) > 1.2


def test_k1_measured_often_takes_its_own_price_above_the_line():
    """A drafter round's fixed part puts k = 1 above the line through k = 2..6 (section
    31: priced 57-61 ms by the line, measured 67-77): a few samples of it still follow the
    line, many take their own mean, and the line for the other k is unchanged."""
    steps = StepCosts(SpeculationConfig(step_weight=0.5))
    for k, s in ((2, 0.08), (4, 0.12), (6, 0.16)):
        for _ in range(16):
            steps.record(1, k, s)
    for _ in range(3):
        steps.record(1, 1, 0.075)
    line = steps(1, 1)
    assert line < 0.07  # the line's price for a k measured only a few times
    for _ in range(5):
        steps.record(1, 1, 0.075)
    assert steps(1, 1) == pytest.approx(0.075)
    assert steps(1, 4) == pytest.approx(0.12, rel=0.05)


def test_every_k_measured_often_takes_its_own_price():
    """Section 40's step medians on the AVX2 CPU at c = 1: not on a line in k. With every
    k measured often, the line through them would price k = 3 at 102 ms (it takes 99) and
    pick k = 2 at a flat 0.9; each k's own price picks k = 3, the better by ~1.4%."""
    accept = [0.9]
    c = Controller(SpeculationConfig(explore_every=0))
    for k, seconds in AVX2_STEP_S.items():
        for _ in range(16):
            c.costs.record_step([k], seconds)
    for k, seconds in AVX2_STEP_S.items():
        assert c.costs.steps(1, k) == pytest.approx(seconds)
    assert best_k(AVX2_STEP_S.get, accept, 6) == 3
    assert c.plan([Candidate(6, accept)]).ks == [3]


def test_a_k_measured_dear_a_few_times_takes_the_price_of_its_neighbours():
    """Early steps at k = 2 fed tree leaves (5 rows, not 3) before the forward had priced
    them; k = 1 and k = 3 ran since, many times, and lie on a line that puts k = 2 where
    it is now: the best k, which the controller would otherwise never run again."""
    accept = [0.9, 0.85, 0.6]

    def true_s(k):
        return 0.05 if k == 0 else 0.052 + 0.03 * k

    c = Controller(SpeculationConfig(explore_every=0))
    for k, n in ((0, 20), (1, 20), (3, 20)):
        for _ in range(n):
            c.costs.record_step([k], true_s(k))
    for _ in range(2):
        c.costs.record_step([2], 1.3 * true_s(2))
    assert c.costs.steps(1, 2) == pytest.approx(true_s(2), rel=0.03)
    assert best_k(true_s, accept, 3) == 2
    assert c.plan([Candidate(3, accept)]).ks == [2]
