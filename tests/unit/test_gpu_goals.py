"""The GPU issue's goals read from a `specd bench gpu` report (bench/gpu/goals.py)."""

import copy
import json

from bench.gpu import goals

SET = {
    "router_on_vs_off": 2.6, "router_auto_vs_better_of_on_off": 0.99,
    "on_vs_in_process": 0.95, "off_vs_in_process": 0.97,
    "identical": True, "router_identical": True, "router_auto_identical": True,
}  # fmt: skip
REPORT = {
    "device": "cuda",
    "gpu": "NVIDIA H200",
    "target": "llama-3.2-3b",
    "decode": {
        "llama-3.2-3b": {"engine_of_limit": 0.55, "engine_vs_transformers": 1.6},
        "qwen2.5-1.5b": {"engine_of_limit": 0.1},  # not the target: no goal reads it
    },
    # one_row_ms is one row's time, not a ratio
    "verification_ratio": {"1": 1.0, 2: 1.02, "8": 1.1, "one_row_ms": 3.0},  # as run.py holds it
    "c32": {"ratio": 16.0, "services_vs_in_process": 0.92},
    "speculation": {
        "lookup": {"identical_to_off": True},
        "draft": {"identical_to_off": True},
        "draft-auto": {"identical_to_off": True, "vs_better_of_on_off": 1.01},
        "services": {
            "lookup": dict(SET),
            "draft": dict(SET, router_on_vs_off=1.25),
            "lookup_in_verifier": dict(SET, router_on_vs_off=3.0),
        },
    },
}


def states(report) -> dict[str, str]:
    return {g["goal"]: g["state"] for g in goals.judge(report)}


def test_a_run_that_meets_every_bound_meets_every_goal():
    assert set(states(REPORT).values()) == {"met"}
    assert len(states(REPORT)) == len(goals.GOALS)


def test_each_figure_past_its_bound_misses_its_goal_alone():
    """One figure at a time moved past its bound: that goal, and no other, is missed;
    the worst of several parts is what counts."""
    moves = {
        0: lambda r: r["decode"]["llama-3.2-3b"].update(engine_of_limit=0.45),
        1: lambda r: r["decode"]["llama-3.2-3b"].update(engine_vs_transformers=1.4),
        2: lambda r: r["verification_ratio"].update({"5": 1.2}),
        3: lambda r: r["speculation"]["services"]["lookup"].update(router_on_vs_off=2.4),
        4: lambda r: r["speculation"]["services"]["draft"].update(router_on_vs_off=1.1),
        5: lambda r: r["speculation"]["services"]["lookup_in_verifier"].update(
            router_auto_vs_better_of_on_off=0.97
        ),
        6: lambda r: r["c32"].update(services_vs_in_process=0.85),
        7: lambda r: r["c32"].update(ratio=14.0),
        8: lambda r: r["speculation"]["services"]["draft"].update(router_auto_identical=False),
    }
    assert sorted(moves) == list(range(len(goals.GOALS)))
    for index, move in moves.items():
        report = copy.deepcopy(REPORT)
        move(report)
        missed = [name for name, state in states(report).items() if state != "met"]
        assert missed == [goals.GOALS[index].name], index


def test_a_part_that_did_not_run_is_not_measured_and_an_in_process_difference_still_misses():
    report = copy.deepcopy(REPORT)
    del report["speculation"]["services"]  # the services failed (services_error)
    del report["decode"]["llama-3.2-3b"]["engine_vs_transformers"]  # the peer failed
    got = states(report)
    measured = {name for name, state in got.items() if state == "met"}
    assert measured == {goals.GOALS[i].name for i in (0, 2, 7)}
    report["speculation"]["draft"]["identical_to_off"] = False
    assert states(report)[goals.GOALS[8].name] == "missed"


def test_the_table_names_the_device_and_reads_a_report_file(tmp_path, capsys):
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(REPORT))
    assert goals.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Goals, NVIDIA H200, target llama-3.2-3b")
    assert out.count("| met |") == len(goals.GOALS) and "Parts ended" not in out
    timed = dict(REPORT, elapsed_s={"decode": 20.5, "verification and c32": 41.0})
    assert "Parts ended at (s from the bench's start): decode 20.5, verification and c32 41." in (
        goals.table(timed)
    )
    emulated = dict(REPORT, gpu=None, device="cpu")
    emulated["emulated_forward_ms"] = {"target": 2.0, "draft": 0.7}
    assert "not a GPU: forwards emulated at target 2 ms, draft 0.7 ms" in goals.table(emulated)
