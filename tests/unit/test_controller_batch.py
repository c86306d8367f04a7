"""The speculation controller at a batch, offline (bench/controller_batch.py): its step
prices, its closed-loop clients, and `auto` against the fixed settings of the goal sweep's
cells on the recorded texts and the measured step table."""

import itertools
import random
import statistics

import pytest

from bench import controller_batch, controller_sim
from bench.controller_batch import POLICY, StepTable, run_cell, trial
from bench.controller_sim import Machine, load_traces
from router.policy import Policy
from verifier_service.records import StepPlan
from verifier_service.speculation import SpeculationControl

TABLE = {
    "1,0": {"rows": 1, "forward": 0.020, "draft": 0.0, "step": 0.025},
    "1,2": {"rows": 3, "forward": 0.030, "draft": 0.020, "step": 0.055},
    "4,0": {"rows": 4, "forward": 0.030, "draft": 0.0, "step": 0.040},
    "4,2": {"rows": 12, "forward": 0.070, "draft": 0.050, "step": 0.130},
}


def test_a_measured_shape_is_priced_as_measured_and_others_between():
    table = StepTable(TABLE)
    assert table.parts(4, 12, 4, 2) == pytest.approx((0.070, 0.050, 0.010))
    assert table.parts(1, 3, 1, 2) == pytest.approx((0.030, 0.020, 0.005))
    assert table.parts(1, 1, 0, 0) == pytest.approx((0.020, 0.0, 0.005))
    # two of four drafting: the round between one's and four's; rows between 4 and 12
    forward, draft, rest = table.parts(4, 8, 2, 2)
    assert draft == pytest.approx(0.020 + 0.030 / 3) and forward == pytest.approx(0.050)
    assert rest == pytest.approx(0.010)
    # one draft deep, on the line through no round and two drafts
    assert table.parts(1, 2, 1, 1)[1] == pytest.approx(0.010)
    # served: a step costs a sequence's share more, whatever it drafts
    served = StepTable(TABLE, served_s=0.003)
    assert served.parts(4, 12, 4, 2) == pytest.approx((0.070, 0.050, 0.022))


class Plain:
    """A control that keeps every sequence plain and keeps what it was shown."""

    def __init__(self):
        self.views, self.reports = [], []

    def plan(self, view):
        self.views.append(view)
        return StepPlan(tuple((0, "off:request", 1.0) for _ in view.ready), 0)

    def observe(self, report):
        self.reports.append(report)


def test_closed_loop_clients_keep_the_batch_to_their_number_and_finish_every_request():
    texts = [[(0, 1)] * n for n in (5, 9, 3, 12, 7, 4, 8)]  # a token a step, plain
    control, machine = Plain(), Machine(0, phases=False)
    policy = Policy.load(str(POLICY)).for_route("code")[1]
    rate = run_cell(control, texts, "auto", machine, StepTable(TABLE), 3, 0.05,
                    random.Random(0), policy)  # fmt: skip
    assert max(v.batch for v in control.views) == 3
    assert any(len(v.ready) < 3 for v in control.views[:-5])  # a client between requests
    decoded, prefilled = {}, {}
    for report in control.reports:
        for r in report.rounds:
            counts = decoded if r.decode else prefilled
            counts[r.seq_id] = counts.get(r.seq_id, 0) + 1
    assert sorted(decoded.values()) == sorted(len(t) for t in texts)
    assert set(prefilled.values()) == {1} and set(prefilled) == set(decoded)
    seconds = sum(report.step_s for report in control.reports)
    assert rate * seconds <= sum(len(t) + 1 for t in texts)  # the gaps count as time too


@pytest.mark.parametrize("workload,ks", [("code", (0, 3, 6)), ("chat", (0, 2, 3))])
def test_auto_keeps_up_with_the_best_fixed_setting_at_every_batch(workload, ks):
    """The goal sweep's cells where the batch decides, offline: at c = 2 and 4 clients
    `auto` under deploy/policy.yaml makes at least 0.97 of the best fixed setting's
    tokens/s (the geometric mean of three trials on the repository's measured table; c = 1
    is test_controller_sim's)."""
    recorded = load_traces(workload)
    policy = Policy.load(str(POLICY)).for_route(workload)[1]
    table = StepTable.load()
    sweeps = [trial(seed, (2, 4), recorded, policy, ks, table=table) for seed in range(3)]
    for clients in (2, 4):
        runs = [sweep[clients] for sweep in sweeps]
        ratio = statistics.geometric_mean([r["auto"] / max(r[k] for k in ks) for r in runs])
        assert ratio > 0.97, (clients, ratio, runs)


@pytest.mark.parametrize("simulator", ["batch", "c=1"])
def test_the_control_counts_the_simulated_machines_seconds(monkeypatch, simulator):
    """The batch memory and the routes' half-life are seconds: in a simulator the
    simulated machine's, as a verifier's are its own (on the wall clock a simulated sweep
    of minutes passes in a second, and a route's memory never fades). Each step's seconds
    have passed on the control's clock by the time it observes the next."""
    seen = []

    class Watched(SpeculationControl):
        def observe(self, report):
            seen.append((self.clock(), report.step_s))
            return super().observe(report)

    if simulator == "batch":
        monkeypatch.setattr(controller_batch, "SpeculationControl", Watched)
        policy = Policy.load(str(POLICY)).for_route("code")[1]
        trial(0, (2,), load_traces("code")[:4], policy, (0,), cells=1, requests=4)
    else:
        monkeypatch.setattr(controller_sim, "SpeculationControl", Watched)
        controller_sim.trial(0, ks=(2,), cells=1, requests=4, tokens=16)
    assert len(seen) > 50
    for (before, _), (after, step_s) in itertools.pairwise(seen):
        assert after - before >= step_s * (1 - 1e-9)


def test_the_verifiers_control_flags_reach_every_simulated_sweep(monkeypatch, capsys):
    """`specd bench controller-batch --explore-every 0` runs its sweeps with the control the
    verifier's own flag would give it (a mechanism switched off offline, as served); a
    value the config refuses is a usage error."""
    configs = []

    def recorded(*args, config=None, **kwargs):
        configs.append(config)
        return {1: {0: 1.0, "auto": 1.0}}

    monkeypatch.setattr(controller_batch, "trial", recorded)
    argv = ["--trials", "2", "--concurrency", "1", "--ks", "0"]
    assert controller_batch.main([*argv, "--explore-window", "0.2", "--explore-every", "0"]) == 0
    assert [(c.explore_window, c.explore_every, c.horizon) for c in configs] == [(0.2, 0, 32)] * 2
    with pytest.raises(SystemExit):
        controller_batch.main([*argv, "--explore-window", "2"])
    assert "explore_window must be in [0, 1]" in capsys.readouterr().err
