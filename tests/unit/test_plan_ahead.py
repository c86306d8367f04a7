"""The next step planned while a queued device (a GPU's) computes this one
(SpeculationControl.plan_ahead): taken where the step is the one expected, planned again,
the budget given back, where it is not; and in the engine, the tokens every request gets."""

from __future__ import annotations

import dataclasses
import random

import pytest

from drafter_service.draft_model import DraftModelProposer
from specd.config import EngineConfig
from specd.params import SamplingParams
from specd.speculation_config import SpeculationConfig
from tests.conftest import run_engine
from verifier_service.engine import Engine
from verifier_service.records import SeqView, StepView
from verifier_service.request import Request, SpeculationBounds
from verifier_service.sequence import Sequence
from verifier_service.speculation import SpeculationControl

AUTO = SpeculationBounds(auto=True)


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _control(clock: FakeClock) -> SpeculationControl:
    """A control that has measured plain and drafting steps of two sequences (drafting
    pays at its acceptance), so that its plans price arms and accrue a budget."""
    control = SpeculationControl(EngineConfig(), clock)
    costs = control.controller.costs
    for k, seconds in ((0, 0.010), (1, 0.013), (2, 0.015), (3, 0.017), (4, 0.019)):
        for _ in range(3):
            costs.record_step([k, k], seconds)
    return control


def _view(*seqs: SeqView, batch: int | None = None) -> StepView:
    return StepView(seqs, len(seqs) if batch is None else batch, 0.1)


def test_a_step_as_expected_takes_the_plan_made_ahead_and_it_is_the_plan_made_now():
    """Two `auto` sequences: the step after one that drafted, planned ahead from the view
    it was expected to leave, is taken as it is (its tokens left may be fewer: drafts were
    accepted), and it decides what planning at the step itself decides."""
    seqs = (SeqView(0, AUTO, AUTO.route, 4, 60, 0, 9), SeqView(1, AUTO, AUTO.route, 4, 50, 3, 4))
    ahead, now = _control(FakeClock()), _control(FakeClock())
    step = ahead.plan(_view(*seqs))
    assert now.plan(_view(*seqs)) == step
    assert all(d.k for d in step.decisions)
    expected = tuple(s.after(d.k) for s, d in zip(seqs, step.decisions, strict=True))
    ahead.plan_ahead(_view(*expected))
    came = tuple(dataclasses.replace(s, remaining=s.remaining - 3) for s in expected)
    planned = ahead.plan(_view(*came))
    assert ahead.planned_ahead == 1
    assert planned == now.plan(_view(*came))
    assert ahead.controller.state() == now.controller.state()


@pytest.mark.parametrize(
    "changed",
    [
        "a sequence joined",
        "the batch grew",
        "a sequence drafted nothing",
        "its tokens left cut its k",
        "the KV pool passed its bound",
    ],
)
def test_a_step_not_as_expected_is_planned_at_the_step_with_the_budget_given_back(changed):
    """Where the step is not the one planned ahead, its plan is made at the step, for the
    sequences it holds, and what planning ahead spent (the exploring count and budget) is
    as if it had never run."""
    bounded = dataclasses.replace(AUTO, max_kv_utilization=0.5)
    seqs = (
        SeqView(0, AUTO, AUTO.route, 4, 60, 0, 0),
        SeqView(1, bounded, bounded.route, 4, 50, 0, 0),
    )
    expected = _view(*(s.after(4) for s in seqs))
    step = {
        "a sequence joined": _view(*expected.ready, SeqView(2, AUTO, AUTO.route, 4, 40, 0, 30)),
        "the batch grew": _view(*expected.ready, batch=3),
        "a sequence drafted nothing": _view(
            expected.ready[0], dataclasses.replace(expected.ready[1], behind=2)
        ),
        "its tokens left cut its k": _view(
            expected.ready[0], dataclasses.replace(expected.ready[1], remaining=3)
        ),
        "the KV pool passed its bound": dataclasses.replace(expected, kv_used=0.6),
    }[changed]
    ahead, now = _control(FakeClock()), _control(FakeClock())
    ahead.plan_ahead(expected)
    planned = ahead.plan(step)
    assert ahead.planned_ahead == 0
    assert len(planned.decisions) == len(step.ready)
    assert planned == now.plan(step)
    assert ahead.controller.state() == now.controller.state()


def _sequence(num_draft: int) -> Sequence:
    request = Request([3, 4, 5, 6], SamplingParams(), max_new_tokens=40, num_draft=num_draft)
    return Sequence.start(0, request, eos_ids=())


@pytest.mark.parametrize("ks", [(0, 0, 2, 0, 0, 3, 3, 0), (2, 0, 2, 2, 0, 0, 0)])
def test_a_view_after_a_step_is_the_sequences_view_once_the_step_is_committed(ks):
    """`SeqView.after` against a Sequence taken through decode steps as the engine commits
    them (a round's drafts counted, the decision recorded, the tokens appended): the same
    steps off and drafter's lag, and at most the tokens left it expects."""
    seq = _sequence(4)
    for k in ks:
        before = SeqView.of(seq)
        accepted = k // 2
        seq.stats.record(k, accepted)
        seq.decided("on" if k else "off:cost", k)
        seq.append([7] * (1 + accepted))
        after, expected = SeqView.of(seq), before.after(k)
        assert (after.off_steps, after.behind) == (expected.off_steps, expected.behind)
        assert after.remaining == expected.remaining - accepted


def _engine(tiny_pair, queued: bool, monkeypatch) -> Engine:
    target, draft = tiny_pair
    proposer = DraftModelProposer(draft, num_blocks=256, block_size=4)
    # a route's rounds kept whole over the test, so what it learned can be counted
    tuned = SpeculationConfig(route_half_life_s=1e9)
    config = EngineConfig(num_blocks=256, block_size=4, speculation=tuned)
    engine = Engine(target, config, proposer, eos_ids=set())
    if queued:  # the forward returns before the wait, as on a GPU (nothing to wait for)
        monkeypatch.setattr(engine.model, "queued", True)
        monkeypatch.setattr(engine.model, "synchronize", lambda: None)
    return engine


def test_a_queued_devices_steps_are_planned_ahead_give_the_same_tokens_and_learn_each_step(
    tiny_pair, monkeypatch
):
    """On a queued device most decode steps take the plan made while the step before
    computed; every request gets the tokens it gets where the device is waited for, and
    by the time the engine is idle, the control has learned every step (the accepted
    share it reports is the engine's own count's)."""
    prompts = [[5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9], [20, 31, 42, 53, 64, 75, 86], [9, 9, 4]]
    reqs = [dict(prompt=p, max_new_tokens=32, num_draft=3, speculation=AUTO) for p in prompts]
    want = run_engine(_engine(tiny_pair, False, monkeypatch), reqs)
    engine = _engine(tiny_pair, True, monkeypatch)
    plans, reports, forwards = [], [], []
    plan, observe, forward = (
        engine.speculation.plan,
        engine.speculation.observe,
        engine.model.forward,
    )
    monkeypatch.setattr(engine.speculation, "plan", lambda view: plans.append(view) or plan(view))
    monkeypatch.setattr(engine.speculation, "observe", lambda r: reports.append(r) or observe(r))
    monkeypatch.setattr(engine.model, "forward", lambda *a: forwards.append(a) or forward(*a))
    assert list(run_engine(engine, reqs).values()) == list(want.values())
    decoding = sum(1 for view in plans if view.ready)
    assert engine.totals.rounds > 0
    assert len(reports) == len(forwards)
    assert engine.speculation.planned_ahead >= 0.75 * decoding
    accepted = engine.acceptance_by_route()[AUTO.route]
    assert accepted == pytest.approx(engine.totals.accepted / engine.totals.drafted, rel=1e-6)


def test_a_queued_device_with_requests_arriving_under_kv_pressure_keeps_every_output(
    tiny_pair, monkeypatch
):
    """Steps not planned for, on a queued device: requests arrive between steps, finish
    at random lengths, run `auto`, fixed k or plain, and a small KV pool preempts. Every
    greedy output is plain decoding's, and every block is free at the end."""
    rnd = random.Random(3)
    reqs = []
    for _ in range(10):
        mode = rnd.choice(["auto", "on", "off"])
        reqs.append(
            dict(
                prompt=[rnd.randrange(1, 96) for _ in range(rnd.randint(3, 14))],
                max_new_tokens=rnd.randint(2, 40),
                num_draft=0 if mode == "off" else rnd.randint(1, 4),
                speculation=AUTO if mode == "auto" else SpeculationBounds(),
            )
        )
    want = run_engine(_engine(tiny_pair, False, monkeypatch), [dict(r, num_draft=0) for r in reqs])
    target, draft = tiny_pair
    engine = Engine(
        target,
        EngineConfig(num_blocks=24, block_size=4, max_batch_size=4),
        DraftModelProposer(draft, num_blocks=128, block_size=4),
        eos_ids=set(),
    )
    monkeypatch.setattr(engine.model, "queued", True)
    monkeypatch.setattr(engine.model, "synchronize", lambda: None)
    ids, got, waiting = [], {}, list(reqs)
    for _ in range(2000):
        if waiting and (not ids or rnd.random() < 0.3):
            ids.append(engine.add_request(Request(**waiting.pop(0))))
            got[ids[-1]] = []
        if not (waiting or engine.has_work()):
            break
        for out in engine.step():
            got[out.seq_id].extend(out.tokens)
    assert [got[i] for i in ids] == list(want.values())
    assert engine.speculation.planned_ahead > 0
    assert engine.kv.allocator.num_used == 0 and engine.proposer.kv.allocator.num_used == 0
