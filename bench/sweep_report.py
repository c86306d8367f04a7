"""`specd bench sweep`'s results: a cell's summary (percentiles, acceptance, decisions),
the markdown table and the files written (the plots: bench/sweep_plot.py)."""

from __future__ import annotations

import json
import math
import statistics
from collections import Counter
from pathlib import Path

from bench.sweep_plot import plot


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def summarise(results: list[dict], wall: float) -> dict:
    ttft = [r["ttft"] for r in results]
    tpot = [r["tpot"] for r in results if r["tpot"] is not None]
    drafted = sum(r["drafted"] for r in results)
    accepted = sum(r["accepted"] for r in results)
    rounds = sum(r["rounds"] for r in results)
    tokens = sum(r["tokens"] for r in results)
    return {
        "requests": len(results),
        "tokens": tokens,
        "seconds": round(wall, 3),
        "tokens_per_s": tokens / wall if wall else 0.0,
        "ttft_p50": percentile(ttft, 0.5),
        "ttft_p99": percentile(ttft, 0.99),
        "tpot_p50": percentile(tpot, 0.5),
        "tpot_p99": percentile(tpot, 0.99),
        "tpot_mean": statistics.fmean(tpot) if tpot else None,
        "acceptance": accepted / drafted if drafted else None,
        "mean_accepted_length": (accepted + rounds) / rounds if rounds else None,
        "reasons": dict(Counter(r["reason"] for r in results)),
    }


def ms(x) -> str:
    return "-" if x is None else f"{x * 1000:.0f} ms"


def to_markdown(report: dict) -> str:
    rows = [
        "| mode | concurrency | tok/s | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | "
        "acceptance | mean accepted length | decisions |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for cell in report["cells"]:
        # a mixed workload's cell, then each route's share of it (same wall time)
        parts = [(cell["mode"], cell)]
        parts += [(f"{cell['mode']} · {r}", c) for r, c in cell.get("routes", {}).items()]
        for mode, c in parts:
            acc = "-" if c["acceptance"] is None else f"{c['acceptance']:.0%}"
            mal = "-" if c["mean_accepted_length"] is None else f"{c['mean_accepted_length']:.2f}"
            reasons = ", ".join(f"{k} {v}" for k, v in sorted(c["reasons"].items()))
            rows.append(
                f"| {mode} | {cell['concurrency']} | {c['tokens_per_s']:.2f} | "
                f"{ms(c['ttft_p50'])} | {ms(c['ttft_p99'])} | {ms(c['tpot_p50'])} | "
                f"{ms(c['tpot_p99'])} | {acc} | {mal} | {reasons} |"
            )
    return "\n".join(rows) + "\n"


def paired_ratios(report: dict) -> list[str]:
    """Each mode's tok/s over the first mode's at each concurrency: merged, and per run
    where cells were repeated (run i of one mode against run i of the other, which ran
    next to it)."""
    cells = report["cells"]
    base = {c["concurrency"]: c for c in cells if c["mode"] == cells[0]["mode"]} if cells else {}
    lines = []
    for cell in cells:
        first = base.get(cell["concurrency"])
        if first is None or first is cell or not first["tokens_per_s"]:
            continue
        line = (
            f"c={cell['concurrency']} {cell['mode']}/{first['mode']} "
            f"{cell['tokens_per_s'] / first['tokens_per_s']:.3f}"
        )
        per_run = [f"{r:.3f}" for r in run_ratios(cell, first)]
        lines.append(line + (f" (runs {' '.join(per_run)})" if per_run else ""))
    return lines


def run_ratios(cell: dict, other: dict) -> list[float]:
    """Run i of `cell` over run i of `other` (repeated cells: the same turn, side by
    side); [] where the cells ran once."""
    pairs = zip(cell.get("runs_tokens_per_s", []), other.get("runs_tokens_per_s", []), strict=True)
    return [a / b for a, b in pairs if a > 0 and b > 0]


def against_best(report: dict, mode: str = "auto") -> list[str]:
    """`mode`'s tok/s over the best other mode's at each concurrency (issue "Load-aware
    speculation": `auto` >= 0.98x the best fixed setting), the best picked by merged tok/s.
    With repeated cells also each run's ratio to the best's run of the same turn, and
    their geometric mean with its standard error: turns ran side by side (A B B A), so a
    pair's ratio is freer of the machine's drift than either cell. Picking the best of
    several noisy modes favours it: modes within noise of each other put `mode` a little
    under 1 even where it runs as well as each of them."""
    lines = []
    for c in dict.fromkeys(cell["concurrency"] for cell in report["cells"]):
        level = [cell for cell in report["cells"] if cell["concurrency"] == c]
        ours = next((cell for cell in level if cell["mode"] == mode), None)
        others = [cell for cell in level if cell["mode"] != mode and cell["tokens_per_s"]]
        if ours is None or not others:
            continue
        best = max(others, key=lambda cell: cell["tokens_per_s"])
        line = (
            f"c={c} {mode}/best ({best['mode']}) {ours['tokens_per_s'] / best['tokens_per_s']:.3f}"
        )
        logs = [math.log(r) for r in run_ratios(ours, best)]
        if len(logs) > 1:
            error = statistics.stdev(logs) / math.sqrt(len(logs))
            each = " ".join(f"{math.exp(x):.3f}" for x in logs)
            line += (
                f" (runs {each}; geometric mean {math.exp(statistics.fmean(logs)):.3f}"
                f" ± {error:.3f})"
            )
        lines.append(line)
    return lines


def summary(report: dict) -> str:
    """The table, then each mode's ratio to the first, `auto` against the best other mode,
    and each peer's ratios (measured in the same run)."""
    lines = paired_ratios(report) + against_best(report) + report.get("peer_ratios", [])
    return to_markdown(report) + "".join(f"\n{line}" for line in lines) + ("\n" if lines else "")


def write_outputs(report: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps(report, indent=1))
    (out / "sweep.md").write_text(summary(report))
    return [out / "sweep.json", out / "sweep.md", *plot(report, out)]
