"""Steps whose drafts were ready (the drafter drafted them ahead while the verifier
verified the round before): priced apart from the steps that waited on the drafter, and
counted in the plan by the chance that a round's drafts are ready."""

import time

import pytest

from specd.config import EngineConfig
from tests.unit.test_engine import PROMPTS
from tests.unit.test_engine_oracle import OracleProposer, greedy_answers
from verifier_service.acceptance import expected_tokens
from verifier_service.controller import Controller, ControllerConfig
from verifier_service.costs import StepCostModel
from verifier_service.engine import Engine
from verifier_service.request import Request
from verifier_service.step_shape import Candidate


def test_ready_steps_are_priced_apart_and_move_no_drafting_price():
    m = StepCostModel()
    for _ in range(40):
        m.record_step([6], 0.128)
    held, pace = m.steps(1, 6), m.steps.pace
    for _ in range(40):
        m.record_step([6], 0.060, primed=True, ready=True)
        m.record_step([6], 0.128, primed=True)
    # the drafting price and the machine's pace are the steps that waited on the drafter
    assert m.steps(1, 6) == pytest.approx(held) and m.steps.pace == pytest.approx(pace)
    assert m.primed_ready(1) == pytest.approx(0.5, abs=0.05)
    assert m.ready_saving(1, 6) == pytest.approx(0.068, rel=0.02)
    # nothing measured at batch 2: no share, no saving
    assert m.primed_ready(2) == 0.0 and m.ready_saving(2, 6) == 0.0


def every(i: int, share: float) -> bool:
    """True for `share` of i = 0, 1, 2, ..., evenly spread."""
    return int((i + 1) * share) > int(i * share)


def steady_then_explored(accept: float, ready_share: float, wait_s, ready_s: float):
    """What a verifier measured running one sequence at k = 4 for 200 steps (a round is
    primed where the last one accepted all four drafts; `ready_share` of those had their
    drafts ready), then exploring k = 6 for 20 steps: switched up from 4, no round of 6
    finds drafts ready (the drafter drafted 4 ahead)."""
    c = Controller(ControllerConfig(explore_every=0))
    primed = 0
    for i in range(200):
        if not every(i, accept**4):
            c.costs.record_step([4], wait_s(4))
            continue
        ready = every(primed, ready_share)
        c.costs.record_step([4], ready_s if ready else wait_s(4), primed=True, ready=ready)
        primed += 1
    for _ in range(20):
        c.costs.record_step([6], wait_s(6))
        c.costs.record_step([0], wait_s(0))
    return c


@pytest.mark.parametrize("per_draft_s", [0.011, 0.02])
def test_a_k_explored_from_another_is_priced_with_its_ready_rounds(per_draft_s):
    """k = 6 run steadily is ready as often as its rounds accept all six drafts, though
    every k = 6 step measured so far waited on the drafter. Priced by its waiting steps
    alone against k = 4's mixed ones, k = 6 made 41 tok/s against k = 4's 48 at 11 ms a
    draft, where in a steady run it makes ~4.5% more, and `auto` held k = 4
    (BENCHMARKS.md section 57). At 20 ms a draft k = 4 is the better one."""
    accept, share, ready_s = 0.9, 0.6, 0.055

    def wait_s(k):
        return 0.05 if k == 0 else 0.06 + per_draft_s * k

    def truth(k):  # tokens/s of a steady run at k
        p_ready = share * accept**k
        seconds = wait_s(k) - p_ready * (wait_s(k) - ready_s)
        return expected_tokens([accept], k) / seconds

    best = max((4, 6), key=truth)
    assert truth(best) > 1.02 * truth(10 - best)
    c = steady_then_explored(accept, share, wait_s, ready_s)
    assert c.costs.primed_ready(1) == pytest.approx(share, abs=0.05)
    assert c.plan([Candidate(6, [accept])]).ks == [best]


class DraftsAhead(OracleProposer):
    """Drafts the greedy answer; a round whose last one was all accepted comes at once
    from its third on (as drafted ahead), every other round after a 40 ms drafter wait."""

    def __init__(self, answers, vocab: int):
        super().__init__(answers, vocab)
        self.last: dict = {}  # seq_id -> (tokens, drafts) of its last round
        self.rounds = self.instant = 0

    def propose(self, states):
        self.rounds += 1
        ahead = self.rounds > 2 and all(self._all_accepted(s) for s in states)
        self.instant += ahead
        if not ahead:
            time.sleep(0.04)
        out = super().propose(states)
        for s, p in zip(states, out, strict=True):
            self.last[s.seq_id] = (list(s.tokens), p.tokens)
        return out

    def _all_accepted(self, s) -> bool:
        tokens, drafts = self.last.get(s.seq_id, (None, None))
        n = None if tokens is None else len(tokens) + len(drafts) + 1
        return n is not None and s.tokens[: n - 1] == tokens + drafts and len(s.tokens) == n


def test_the_engine_tells_ready_rounds_from_rounds_that_waited(tiny_pair):
    target, _ = tiny_pair
    req = dict(prompt=PROMPTS[3], max_new_tokens=60)
    answers = greedy_answers(tiny_pair, [req])
    proposer = DraftsAhead(answers, target.args.vocab_size)
    engine = Engine(target, EngineConfig(num_blocks=256, block_size=4), proposer, eos_ids=set())
    seq_id = engine.add_request(Request(**req, num_draft=4))
    out = []
    while engine.has_work():
        for o in engine.step():
            assert o.seq_id == seq_id
            out.extend(o.tokens)
    assert out == answers[tuple(req["prompt"])]
    costs = engine.scheduler.controller.costs
    assert proposer.instant >= 8
    # every round after the first was primed (all accepted); all but one came at once
    assert costs.primed_ready(1) > 0.7
    assert sum(costs.ready[1].samples(k) for k in range(1, 5)) >= proposer.instant - 1
    # the drafter's round price holds the rounds that ran it, not the instant ones
    assert costs.draft[1](4) > 0.03
    assert costs.ready_saving(1, 4) > 0.01
    assert engine.kv.allocator.num_used == 0
