"""`specd bench steps`: what whole decode steps of the real pair cost by (sequences, depth),
for `specd bench controller-batch` to price the steps it simulates.

    specd bench steps [--sizes 1,2,3,4,6,8,12,16] [--ks 0,1,2,3,4,5,6] [--out FILE]

The verifier's engine at its default flags serves the default target; the drafter's
default model (as `specd serve drafter` loads it) drafts in-process, every round its k
(p_min 0), with its runner-up alternatives. Per (sequences, k): the medians of the decode
steps where every round drafted k and nothing caught up (the forward, the drafter's round,
the whole step) and the rows they fed, and what a request's first drafting round adds;
with this machine's CPU beside them. In-process: no gRPC hop, which a served step adds.
`specd bench gpu` measures the same on a GPU, with random weights of the real shapes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from bench.controller_batch import STEPS
from specd.models.native import cpu_isa


def _cpu() -> str:
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    fields: dict[str, str] = {}
    for line in info.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    cores = info.count("model name")
    return (f"{fields.get('model name', 'unknown')} (family {fields.get('cpu family', '?')}, "
            f"model {fields.get('model', '?')}), {cores} cores, kernels "
            f"{cpu_isa() or 'none'}")  # fmt: skip


def measure(engine, prompts: list[list[int]], sizes, ks, tokens=(96, 64)) -> dict:
    """Whole decode steps of `engine` (its proposer drafting every round's k) by
    (sequences, k): {"steps": {"n,k": medians}, "first_round_s": what a sequence's first
    drafting round adds to the drafter's (its prompt caught up, from the drafter's prefix
    cache as the sweep's warm-up leaves it)}. `tokens`: generated a request below batch 8,
    and from it."""
    from verifier_service.request import Request

    steps: list[tuple] = []
    firsts: dict[int, list[float]] = {}
    shortest = min(len(p) for p in prompts)
    observe = engine.speculation.observe

    def record(report):
        rounds = report.rounds
        depth = max((r.drafted for r in rounds), default=0)
        if rounds and all(r.decode and r.drafted == depth for r in rounds):
            if not any(r.behind and r.planned for r in rounds):
                rows = sum(r.rows for r in rounds)
                steps.append((len(rounds), depth, rows, report.forward_s, report.draft_s,
                              report.step_s))  # fmt: skip
            elif len(rounds) == 1 and depth and rounds[0].behind >= shortest:  # a prompt
                firsts.setdefault(depth, []).append(report.draft_s)
        return observe(report)

    engine.speculation.observe = record

    def run(n: int, k: int, new: int) -> None:
        for i in range(n):
            request = Request(prompts[i % len(prompts)], max_new_tokens=new, ignore_eos=True,
                              num_draft=k)  # fmt: skip
            engine.add_request(request)
        while engine.has_work():
            engine.step()

    run(max(sizes), 2, 4)  # every prompt in both prefix caches
    table = {}
    for n in sizes:
        for k in ks:
            steps.clear()
            run(n, k, tokens[0] if n < 8 else tokens[1])
            mine = [s for s in steps if s[:2] == (n, k)]
            if mine:
                parts = ("rows", "forward", "draft", "step")
                table[f"{n},{k}"] = {p: statistics.median(s[2 + i] for s in mine)
                                     for i, p in enumerate(parts)}  # fmt: skip
                table[f"{n},{k}"]["samples"] = len(mine)
                print(n, k, {key: round(v, 4) for key, v in table[f"{n},{k}"].items()}, flush=True)
    engine.speculation.observe = observe
    extra = [s - table[f"1,{k}"]["draft"] for k, ss in firsts.items() if f"1,{k}" in table
             for s in ss]  # fmt: skip
    return {"steps": table, "first_round_s": statistics.median(extra) if extra else None}


def real_pair_engine():
    """The verifier's engine at its default flags on the default target, with the
    drafter's default model (as `specd serve drafter` loads it) drafting in-process, every
    round its k (p_min 0), with its runner-up alternatives; and the code prompts."""
    from bench.prompts import load_workload
    from drafter_service.draft_model import DraftModelProposer, load_draft_model
    from specd.config import DrafterConfig, EngineConfig
    from specd.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET
    from specd.models.loader import load_model, load_tokenizer
    from specd.models.resolve import resolve
    from verifier_service.engine import Engine

    folder, cfg = resolve(DEFAULT_TARGET), DrafterConfig()
    prompts = load_workload("code", load_tokenizer(folder))
    draft = load_draft_model(DEFAULT_DRAFT, weights=cfg.weights, vocab=cfg.vocab)
    proposer = DraftModelProposer(draft, num_blocks=4096, alternatives=cfg.alternatives,
                                  prefix_cache=True)  # fmt: skip
    return Engine(load_model(folder, weights="auto"), EngineConfig(), proposer), prompts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specd bench steps", description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="1,2,3,4,6,8,12,16", help="sequences a step (%(default)s)")
    p.add_argument("--ks", default="0,1,2,3,4,5,6", help="drafts a round (%(default)s)")
    p.add_argument("--out", default=str(STEPS), help="write the table here (%(default)s)")
    args = p.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",")]
    engine, prompts = real_pair_engine()
    table = measure(engine, prompts, sizes, [int(x) for x in args.ks.split(",")])
    report = {"machine": _cpu(), "date": time.strftime("%Y-%m-%d"), **table}
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
