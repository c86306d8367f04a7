"""`specd bench sweep`'s comparison of `auto` with the best other mode (bench/sweep_report.py),
on reports made by hand: the issue's goal is read from these lines; and its plots' lines
(bench/sweep_plot.py)."""

import math

from bench.sweep_plot import lines, plot
from bench.sweep_report import against_best, summary, to_markdown


def cell(mode: str, c: int, runs: list[float]) -> dict:
    # merged tok/s of runs of equal length: their mean
    out = {"mode": mode, "concurrency": c, "tokens_per_s": sum(runs) / len(runs)}
    if len(runs) > 1:
        out["runs_tokens_per_s"] = runs
    return out


def test_auto_is_compared_with_the_best_other_mode_at_each_level_run_by_run():
    report = {
        "cells": [
            cell("off", 1, [20.0, 22.0]),
            cell("on@k3", 1, [40.0, 44.0]),
            cell("auto", 1, [42.0, 41.8]),
            cell("off", 4, [80.0, 76.0]),
            cell("on@k3", 4, [70.0, 72.0]),
            cell("auto", 4, [76.0, 79.8]),
        ]
    }
    c1, c4 = against_best(report)
    # c = 1: on@k3 is best (42 merged); auto merged 41.9
    assert c1.startswith("c=1 auto/best (on@k3) 0.998 (runs 1.050 0.950; ")
    logs = [math.log(42 / 40), math.log(41.8 / 44)]
    mean = math.exp(sum(logs) / 2)
    error = abs(logs[0] - logs[1]) / 2  # two runs: sd / sqrt(2) is half their spread
    assert c1.endswith(f"geometric mean {mean:.3f} ± {error:.3f})")
    # c = 4: off (78 merged) is the best other mode, on@k3 (71) is not
    assert c4.startswith("c=4 auto/best (off) 0.999 (runs 0.950 1.050; ")


def test_a_level_without_auto_or_without_another_mode_has_no_line_and_one_run_no_spread():
    report = {
        "cells": [
            cell("off", 1, [20.0]),
            cell("auto", 1, [30.0]),
            cell("off", 2, [40.0]),
            cell("auto", 8, [90.0]),
        ]
    }
    assert against_best(report) == ["c=1 auto/best (off) 1.500"]
    assert against_best(report, mode="off") == ["c=1 off/best (auto) 0.667"]


def test_the_throughput_plot_draws_the_peers_of_the_same_run_beside_specd(tmp_path):
    report = {
        "cells": [
            {"mode": m, "concurrency": c, "tokens_per_s": r, "tpot_p99": 0.03}
            for m, c, r in [
                ("off", 1, 28.0),
                ("auto", 1, 55.0),
                ("off", 4, 80.0),
                ("auto", 4, 90.0),
            ]
        ],
        "llamacpp": {
            "llamacpp": [
                {"concurrency": 1, "tokens": 960, "tokens_per_s": 30.0},
                {"concurrency": 4, "tokens": 960, "tokens_per_s": 70.0},
            ],
            "llamacpp-draft": {"error": "this build has no --model-draft"},
        },
        "peer": {"hf:plain": {"tokens": 512, "seconds": 64.0, "tok_per_s": 8.0}},
    }
    assert lines(report, "tokens_per_s") == {
        "specd off": ([1, 4], [28.0, 80.0], False),
        "specd auto": ([1, 4], [55.0, 90.0], False),
        "llama-server llamacpp": ([1, 4], [30.0, 70.0], True),
        "hf:plain": ([1], [8.0], True),
    }
    assert set(lines(report, "tpot_p99")) == {"specd off", "specd auto"}  # peers time no tokens
    assert [p.name for p in plot(report, tmp_path)] == [
        "sweep_tokens_per_s.png",
        "sweep_tpot_p99.png",
    ]


def test_the_markdown_holds_the_ratios_printed_with_it():
    times = dict(ttft_p50=0.05, ttft_p99=0.08, tpot_p50=0.03, tpot_p99=0.04)
    report = {
        "cells": [
            dict(
                cell("off", 1, [28.0]),
                acceptance=None,
                mean_accepted_length=None,
                **times,
                reasons={"off:client": 16},
            ),
            dict(
                cell("auto", 1, [56.0]),
                acceptance=0.8,
                mean_accepted_length=4.4,
                **times,
                reasons={"on": 16},
            ),
        ],  # fmt: skip
        "peer_ratios": ["specd off (c=1, 28.0 tok/s) / llamacpp (30.0 tok/s): 0.93x"],
    }
    text = summary(report)
    assert text.startswith(to_markdown(report))
    assert text[len(to_markdown(report)) :].splitlines() == [
        "",
        "c=1 auto/off 2.000",
        "c=1 auto/best (off) 2.000",
        "specd off (c=1, 28.0 tok/s) / llamacpp (30.0 tok/s): 0.93x",
    ]
