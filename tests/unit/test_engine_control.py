"""The verifier engine's speculation control with tiny models: what it measures of the
steps, what it prices, and the bounds on k it keeps (the plans themselves are
test_controller's)."""

import pytest

from specd.speculation_config import SpeculationConfig
from tests.conftest import run_engine
from tests.unit.test_engine import PROMPTS, make_engine
from verifier_service.request import Request, SpeculationBounds


@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_steps_of_ngram_drafts_alone_stay_out_of_the_step_costs(tiny_pair, kind):
    """A step whose every round was an n-gram continuation ran no draft model: it must
    not price a drafting step or a drafter round (the forward by rows it still measures),
    but a lookup step, and its route's share of such rounds. The same requests drafted by
    the model price both and no lookup."""
    engine = make_engine(tiny_pair, kind)
    reqs = [dict(prompt=PROMPTS[0] * 3, max_new_tokens=24, num_draft=3)]
    run_engine(engine, reqs)
    assert engine.totals.drafted > 0  # drafts came either way
    controller = engine.speculation.controller
    costs = controller.costs
    drafting_steps = [key for key in costs.steps.measured() if key[1] > 0]
    assert costs.forward.measured()
    if kind == "ngram":
        assert drafting_steps == [] and costs.draft == {}
        assert costs.lookup.measured() and controller.lookups("default") > 0.5
    else:
        assert drafting_steps and costs.draft
        assert not costs.lookup.measured() and controller.lookups("default") == 0.0


def test_draft_below_batch_speculates_only_while_the_batch_is_small(tiny_pair):
    # lengths differ, so the batch shrinks 4 -> 3 -> 2 -> 1 as requests finish
    reqs = [dict(prompt=p, max_new_tokens=16 + 8 * i) for i, p in enumerate(PROMPTS)]
    off = run_engine(make_engine(tiny_pair), reqs)
    drafted = {}
    for limit in (0, 10, 2):
        engine = make_engine(tiny_pair, "draft", speculation=SpeculationConfig(batch_memory_s=0.0))
        gate = SpeculationBounds(draft_below_batch=limit)
        got = run_engine(engine, [dict(r, num_draft=3, speculation=gate) for r in reqs])
        assert list(got.values()) == list(off.values())
        drafted[limit] = engine.totals.drafted
    assert drafted[10] == drafted[0] > 0  # a limit the batch never reaches changes nothing
    assert 0 < drafted[2] < drafted[0] / 2  # with limit 2: only the last request's tail
    # the gate remembers the largest recent batch: with a long memory, no tail drafting
    engine = make_engine(tiny_pair, "draft", speculation=SpeculationConfig(batch_memory_s=60.0))
    gate = SpeculationBounds(draft_below_batch=2)
    run_engine(engine, [dict(r, num_draft=3, speculation=gate) for r in reqs])
    assert engine.totals.drafted == 0


def test_auto_k_never_exceeds_the_routes_bound_and_keeps_the_output(tiny_pair):
    engine = make_engine(tiny_pair, "draft")
    seen = []
    real = engine.proposer.propose

    def spy(states):
        seen.extend((s.k, s.seq_id) for s in states)
        return real(states)

    engine.proposer.propose = spy
    reqs = [
        dict(prompt=p, max_new_tokens=30, num_draft=k, speculation=SpeculationBounds(auto=True))
        for p, k in zip(PROMPTS, [2, 5, 3, 1], strict=True)
    ]
    ref = run_engine(make_engine(tiny_pair), [dict(r, num_draft=0) for r in reqs])
    got = run_engine(engine, reqs)
    assert list(got.values()) == list(ref.values())
    bounds = {i: r["num_draft"] for i, r in zip(got, reqs, strict=True)}
    assert seen and all(k <= bounds[seq_id] for k, seq_id in seen)


def test_whole_decode_steps_are_measured_by_their_plan_and_switches_apart(tiny_pair):
    # without the cost model `auto` drafts its cap (the tiny target is too fast to pay),
    # and every decode step is still measured for the model
    engine = make_engine(tiny_pair, "draft", cost_model=False)
    costs, events = engine.speculation.controller.costs, []
    for name in ("record_draft", "record_forward", "record_step"):
        real = getattr(costs, name)

        def spy(*args, name=name, real=real):
            events.append((name, args))
            return real(*args)

        setattr(costs, name, spy)
    auto = SpeculationBounds(auto=True)
    reqs = [dict(prompt=p, max_new_tokens=20, num_draft=3, speculation=auto) for p in PROMPTS[:2]]
    run_engine(engine, reqs)
    steps = [args for name, args in events if name == "record_step"]
    assert steps and all(len(ks) <= 2 and max(ks) <= 3 and s > 0 for ks, s, *_ in steps)
    # each with its forward: the rows it fed (one a sequence, and its drafts) and a part of
    # its seconds
    assert all(rows >= len(ks) and 0 < forward_s < s for ks, s, _, _, rows, forward_s in steps)
    # the first decode step is both sequences' first round: the drafter prefills their
    # whole contexts (prompt + first token), which is a switch's cost, not a step's
    first = next(i for i, (name, _) in enumerate(events) if name == "record_step")
    ks, _, catch_up, stopping, _, _ = events[first][1]
    assert ks == [3, 3] and stopping == 0
    assert catch_up == sum(len(p) + 1 for p in PROMPTS[:2])
    steady = {(len(ks), max(ks)) for ks, _, behind, stop, *_ in steps if not behind and not stop}
    assert steady and any(k for _, k in steady)
    assert set(costs.steps.measured()) == steady
    # a drafter round is a steady one, for the round curve, only where the drafter did not
    # catch up first: the first round (a whole prompt) is not recorded, later ones are
    group, rounds = [], []
    for name, args in events:
        group.append((name, args))
        if name == "record_step":
            ks, _, catch_up, *_ = args
            drafted = [a for n, a in group if n == "record_draft" and a[0] > 0]
            rounds.append((max(ks) > 0 and not catch_up, bool(drafted)))
            group = []
    assert rounds[0] == (False, False) and (True, True) in rounds
    assert all(steady_round == recorded for steady_round, recorded in rounds)


def test_a_request_asking_past_the_engines_bound_drafts_within_it(tiny_pair):
    """k's bound is the engine's, applied once as a request comes in: admission reserves
    for it and no round drafts past it, whatever the request asked."""
    engine = make_engine(tiny_pair, "draft", max_draft_tokens=2)
    seq_id = engine.add_request(Request(PROMPTS[0], max_new_tokens=16, num_draft=6))
    assert engine.sequence(seq_id).num_draft == 2
    most = 0
    while engine.has_work():
        most = max([most] + [o.drafted for o in engine.step()])
    assert most == 2


def test_the_steps_the_control_priced_are_counted_with_what_they_did(tiny_pair):
    """Engine.priced: each decode step the speculation control priced and that ran as
    planned, by the most drafts planned, with the tokens and seconds it expected and what
    the step emitted and took (the verifier's metrics show their sums). No dip memory: a
    plan it keeps plain for a dip is not priced, and how long a dip lasts is wall-clock."""
    engine = make_engine(tiny_pair, "draft", speculation=SpeculationConfig(batch_memory_s=0.0))
    auto = SpeculationBounds(auto=True)
    for p in PROMPTS[:2]:
        engine.add_request(
            Request(p, max_new_tokens=24, num_draft=3, speculation=auto, ignore_eos=True)
        )
    counted, late, steps, first_of_late = 0, None, 0, True
    while engine.has_work():
        steps += 1
        if steps == 6:  # a request comes while they decode: its prefill is no priced step
            late = engine.add_request(Request(PROMPTS[2], max_new_tokens=4, speculation=auto))
        before, step_s = engine.load().priced, engine.step_s
        outputs = engine.step()
        emitted = sum(len(out.tokens) for out in outputs)
        after = engine.load().priced
        if late is not None and any(out.seq_id == late for out in outputs):
            if first_of_late:
                assert after.steps == before.steps
            first_of_late = False
        if after.steps > before.steps:  # this step was priced: what it emitted and took
            counted += 1
            assert after.tokens - before.tokens == emitted
            assert after.seconds - before.seconds == pytest.approx(engine.step_s - step_s)
            assert after.expected_seconds > before.expected_seconds
    priced, total = engine.priced, engine.load().priced
    assert total.steps == sum(p.steps for p in priced.values()) == counted > 10
    # a plain step emits a token a sequence, as the plan expects
    assert priced[0].tokens == priced[0].expected_tokens >= priced[0].steps
