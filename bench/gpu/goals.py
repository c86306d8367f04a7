"""The GPU issue's measured goals, read from a `specd bench gpu` report: each goal's
figure, its bound, and whether the run met it (or did not measure it: a part that failed
or was skipped). The goals are an H200's (bf16, one run each); on an emulated CPU run
they say only how the harness reads.

    python -m bench.gpu.goals gpu.json     # the table, as BENCHMARKS.md shows it
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Goal:
    name: str
    bound: float
    at_least: bool  # the figure must be >= bound (else <=)
    read: Callable[[dict], float]  # the report -> the figure (raises where its part is absent)

    def judge(self, report: dict) -> dict:
        try:
            value = self.read(report)
        except (KeyError, TypeError, ValueError):  # a part missing from the report
            value = None  # not measured
        if value is None:
            state = "not measured"
        else:
            met = value >= self.bound if self.at_least else value <= self.bound
            state = "met" if met else "missed"
        sign = ">=" if self.at_least else "<="
        needs = f"{sign} {self.bound:g}"
        return {"goal": self.name, "needs": needs, "value": value, "state": state}


def _target(report: dict) -> dict:
    return report["decode"][report["target"]]


def _verification(report: dict) -> float:
    """The dearest verification step of 2 to 8 rows against one row's."""
    ratios = {str(rows): v for rows, v in report["verification_ratio"].items()}  # JSON's or not
    return max(v for rows, v in ratios.items() if rows.isdigit() and 2 <= int(rows) <= 8)


def _services(report: dict) -> dict:
    return report["speculation"]["services"]


def _auto(report: dict) -> float:
    """`auto` against the better of `on` and `off`: in-process, and through every router."""
    spec = report["speculation"]
    through = [s["router_auto_vs_better_of_on_off"] for s in _services(report).values()]
    return min([spec["draft-auto"]["vs_better_of_on_off"], *through])


def _services_cost(report: dict) -> float:
    """The services' speed against the same engine in-process, the worst of every set's
    `on` and `off` and of c = 32 plain."""
    sets = _services(report).values()
    ratios = [s[key] for s in sets for key in ("on_vs_in_process", "off_vs_in_process")]
    return min([*ratios, report["c32"]["services_vs_in_process"]])


def _identical(report: dict) -> float:
    """1 where every greedy output with speculation equals plain's, in-process and through
    the services (verifier and router, every mode); else 0: a difference in-process counts
    where the services did not run."""
    spec = report["speculation"]
    flags = [spec[m]["identical_to_off"] for m in ("lookup", "draft", "draft-auto")]
    if not all(flags):
        return 0.0
    for s in _services(report).values():
        flags += [s["identical"], s["router_identical"], s["router_auto_identical"]]
    return float(all(flags))


GOALS = (
    Goal("plain decode, c = 1: share of the HBM limit", 0.5, True,
         lambda r: _target(r)["engine_of_limit"]),
    Goal("plain decode, c = 1: against transformers (static cache, compiled)", 1.5, True,
         lambda r: _target(r)["engine_vs_transformers"]),
    Goal("verification of 2 to 8 rows: against one row", 1.15, False, _verification),
    Goal("speculation through the router, lookup drafts (a drafter process): against off",
         2.5, True, lambda r: _services(r)["lookup"]["router_on_vs_off"]),
    Goal("speculation through the router, the draft model: against off", 1.2, True,
         lambda r: _services(r)["draft"]["router_on_vs_off"]),
    Goal("auto: against the better of on and off, in-process and through each router",
         0.98, True, _auto),
    Goal("the services: against the same engine in-process (worst part)", 0.9, True,
         _services_cost),
    Goal("c = 32 plain: against c = 1", 15.0, True, lambda r: r["c32"]["ratio"]),
    Goal("greedy output with speculation equals off, every mode (1: yes)", 1.0, True,
         _identical),
)  # fmt: skip


def judge(report: dict) -> list[dict]:
    """Every goal's figure and state in `report` (a `specd bench gpu` report)."""
    return [goal.judge(report) for goal in GOALS]


def table(report: dict) -> str:
    """The goals as a Markdown table, headed by the device the report ran on."""
    where = report.get("gpu") or report.get("device", "?")
    if emulated := report.get("emulated_forward_ms"):
        ms = ", ".join(f"{role} {value:g} ms" for role, value in emulated.items())
        where += f" (not a GPU: forwards emulated at {ms})"
    lines = [f"Goals, {where}, target {report.get('target', '?')}:", ""]
    lines += ["| goal | needs | measured | |", "| --- | --- | --- | --- |"]
    for g in report.get("goals") or judge(report):
        value = "-" if g["value"] is None else f"{g['value']:.3g}"
        lines.append(f"| {g['goal']} | {g['needs']} | {value} | {g['state']} |")
    if elapsed := report.get("elapsed_s"):  # where the run's time went (a part cut short: absent)
        ends = ", ".join(f"{part} {s:g}" for part, s in elapsed.items())
        lines += ["", f"Parts ended at (s from the bench's start): {ends}."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    summary = __doc__.split("\n")[0]
    p = argparse.ArgumentParser(prog="python -m bench.gpu.goals", description=summary)
    p.add_argument("report", help="a `specd bench gpu --json` file")
    args = p.parse_args(argv)
    print(table(json.loads(Path(args.report).read_text())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
