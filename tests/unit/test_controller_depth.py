"""The controller pricing a step by how deep its rounds go: the drafter stops a round after
an unsure draft, more often on some routes than on others (docs/benchmarks-log.md section 53)."""

import collections
import random

import pytest

from specd.speculation_config import SpeculationConfig
from verifier_service.speculation.controller import Controller
from verifier_service.speculation.step_shape import (
    Candidate,
    Fixed,
    arm_shapes,
    deepest,
    reach,
    step_shape,
)


def _mixed_round(rnd, a: float, goes_on: float, k: int) -> tuple[int, int]:
    """One round planned at k: (drafts that came, accepted), the drafter going on after
    each draft with chance `goes_on`, the target accepting each with chance `a`."""
    came = 1
    while came < k and rnd.random() < goes_on:
        came += 1
    accepted = 0
    while accepted < came and rnd.random() < a:
        accepted += 1
    return came, accepted


# a step of one sequence: the forward, the drafter round's fixed part, each draft
def _mixed_step_s(drafts: int) -> float:
    return 0.037 + (0.006 + 0.0075 * drafts if drafts else 0.0)


MIXED = {"code": (0.87, 0.95, 6), "chat": (0.7, 0.45, 3)}  # a, goes on, the route's k


def _run_mixed(by_drafts: bool, requests: int = 60, rounds: int = 15) -> collections.Counter:
    """Requests of code and chat in turn at c = 1, each `rounds` rounds. `by_drafts`: as
    the engine and the controller do (steps priced by the drafts that came, plans by how
    deep a route's rounds go); else by the k planned, as before (docs/benchmarks-log.md section
    53). -> the k planned for code's rounds in the second half."""
    rnd = random.Random(7)
    c = Controller(SpeculationConfig(explore_every=0))
    code_ks = collections.Counter()
    for i in range(requests):
        route = "code" if i % 2 == 0 else "chat"
        a, goes_on, cap = MIXED[route]
        for _ in range(rounds):
            rates = c.route_rates(route)
            shape = c.goes_on(route) if by_drafts else []
            k = c.plan([Candidate(cap, rates, goes_on=shape)]).ks[0]
            came, accepted = _mixed_round(rnd, a, goes_on, k) if k else (0, 0)
            c.record(route, k, accepted, came)
            c.costs.record_step([came if by_drafts else k], _mixed_step_s(came))
            if route == "code" and i >= requests // 2:
                code_ks[k] += 1
    return code_ks


def test_mixed_routes_price_a_round_by_how_deep_it_goes():
    """Chat's drafter stops early (a round planned at 3 drafts ~1.5), code's rarely. Priced
    by the k planned, chat's cheap k = 3 steps set code's price of k = 3, and code ran at
    k = 3-4 where 6 was best (through the API: 0.91 of the fixed k = 6); priced by the
    drafts that came and each route's depth, code runs at the best k."""
    rnd = random.Random(1)
    true_rate = {}
    for k in range(MIXED["code"][2] + 1):
        runs = [_mixed_round(rnd, 0.87, 0.95, k) if k else (0, 0) for _ in range(20000)]
        tokens = sum(1 + accepted for _, accepted in runs)
        true_rate[k] = tokens / sum(_mixed_step_s(came) for came, _ in runs)
    best = max(true_rate, key=true_rate.get)
    assert best >= 5

    def rate(ks: collections.Counter) -> float:
        return sum(n * true_rate[k] for k, n in ks.items()) / sum(ks.values())

    new, old = _run_mixed(by_drafts=True), _run_mixed(by_drafts=False)
    assert rate(new) >= 0.99 * true_rate[best], (new, true_rate)
    assert rate(old) < 0.97 * true_rate[best], (old, true_rate)  # what it replaces


def test_every_arm_shaped_at_once_as_each_alone():
    """`arm_shapes` takes the deepest round's product once for all k: each arm's shape is
    `step_shape`'s at those k to the last bit, beside a rest of the batch deeper than some
    arms, shallower than others, or none; candidates of several caps (0 among them)."""
    rnd = random.Random(3)
    for _ in range(200):
        candidates = [
            Candidate(
                rnd.randint(0, 6),
                [rnd.random() for _ in range(rnd.randint(1, 4))],
                goes_on=[rnd.random() for _ in range(rnd.randint(0, 3))],
            )
            for _ in range(rnd.randint(1, 9))
        ]
        rest = [([0.7], [rnd.random()], rnd.randint(0, 8)) for _ in range(rnd.randint(0, 3))]
        fixed = Fixed.of(rest) if rnd.random() < 0.8 else Fixed(1, 4.0, 2.0, rnd.randint(0, 8))
        shapes = arm_shapes(candidates, fixed)
        assert len(shapes) == max(c.cap for c in candidates) + 1
        for k, shape in enumerate(shapes):
            assert shape == step_shape(candidates, [min(k, c.cap) for c in candidates], fixed)


def test_the_deepest_of_rounds_that_stop_early():
    assert reach([], 3) == [1.0, 1.0, 1.0]  # no measure: every planned draft comes
    assert reach([0.5], 3) == [1.0, 0.5, 0.25]
    assert reach([0.5, 0.8], 4) == pytest.approx([1.0, 0.5, 0.4, 0.32])
    # two such rounds: P(max >= j) = 1 - (1 - p)^2, and a shorter round adds nothing past it
    assert deepest([[1.0, 0.5, 0.25], [1.0, 0.5]]) == pytest.approx([1.0, 0.75, 0.25])
    c = Controller()
    for came in (1, 2, 2, 3, 3, 3):  # planned at 3: c_0 = 5/6, c_1 = 3/5, over priors
        c.record("chat", 3, 0, came)
    c0 = (5 + 2 * 1.0) / (6 + 2)  # the prior of always, weighing 2 rounds
    assert c.goes_on("chat") == pytest.approx([c0, (3 + 2 * c0) / (5 + 2)])
    assert c.goes_on("code") == []
