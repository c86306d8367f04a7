"""`specd bench steps`: what whole decode steps of the real pair cost by (sequences, depth),
for `specd bench controller --concurrency` to price the steps it simulates.

    specd bench steps [--sizes 1,2,3,4,6,8,12,16] [--ks 0,1,2,3,4,5,6] [--out FILE]

The verifier's engine at its default flags serves the default target; the drafter's
default model (as `specd serve drafter` loads it) drafts in-process, every round its k
(p_min 0), with its runner-up alternatives. Per (sequences, k): the medians of the decode
steps where every round drafted k and nothing caught up (the forward, the drafter's round,
the whole step) and the rows they fed, with this machine's CPU beside them. In-process:
no gRPC hop, which a served step adds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from bench.controller_batch import STEPS


def _cpu() -> str:
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    fields: dict[str, str] = {}
    for line in info.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    isa = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "other"
    cores = info.count("model name")
    return (f"{fields.get('model name', 'unknown')} (family {fields.get('cpu family', '?')}, "
            f"model {fields.get('model', '?')}), {cores} cores, {isa}")  # fmt: skip


def measure(sizes: list[int], ks: list[int]) -> dict:
    from bench.prompts import load_workload
    from drafter_service.draft_model import DraftModelProposer, load_draft_model
    from specd.config import DrafterConfig, EngineConfig
    from specd.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET
    from specd.models.loader import load_model, load_tokenizer
    from specd.models.resolve import resolve
    from verifier_service.engine import Engine
    from verifier_service.request import Request

    folder, cfg = resolve(DEFAULT_TARGET), DrafterConfig()
    prompts = load_workload("code", load_tokenizer(folder))
    draft = load_draft_model(DEFAULT_DRAFT, weights=cfg.weights, vocab=cfg.vocab)
    proposer = DraftModelProposer(draft, num_blocks=4096, alternatives=cfg.alternatives,
                                  prefix_cache=True)  # fmt: skip
    engine = Engine(load_model(folder, weights="auto"), EngineConfig(), proposer)
    steps: list[tuple] = []
    observe = engine.speculation.observe

    def record(report):
        rounds = report.rounds
        if rounds and all(r.decode and not (r.behind and r.planned) for r in rounds):
            depth = max(r.drafted for r in rounds)
            if all(r.drafted == depth for r in rounds):
                rows = sum(r.rows for r in rounds)
                steps.append((len(rounds), depth, rows, report.forward_s, report.draft_s,
                              report.step_s))  # fmt: skip
        return observe(report)

    engine.speculation.observe = record

    def run(n: int, k: int, tokens: int) -> None:
        for i in range(n):
            request = Request(prompts[i % len(prompts)], max_new_tokens=tokens, ignore_eos=True,
                              num_draft=k)  # fmt: skip
            engine.add_request(request)
        while engine.has_work():
            engine.step()

    run(max(sizes), 2, 4)  # every prompt in both prefix caches
    out = {}
    for n in sizes:
        for k in ks:
            steps.clear()
            run(n, k, 96 if n < 8 else 64)
            mine = [s for s in steps if s[:2] == (n, k)]
            if mine:
                parts = ("rows", "forward", "draft", "step")
                out[f"{n},{k}"] = {p: statistics.median(s[2 + i] for s in mine)
                                   for i, p in enumerate(parts)}  # fmt: skip
                out[f"{n},{k}"]["samples"] = len(mine)
                print(n, k, {key: round(v, 4) for key, v in out[f"{n},{k}"].items()}, flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specd bench steps", description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="1,2,3,4,6,8,12,16", help="sequences a step (%(default)s)")
    p.add_argument("--ks", default="0,1,2,3,4,5,6", help="drafts a round (%(default)s)")
    p.add_argument("--out", default=str(STEPS), help="write the table here (%(default)s)")
    args = p.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",")]
    table = measure(sizes, [int(x) for x in args.ks.split(",")])
    report = {"machine": _cpu(), "date": time.strftime("%Y-%m-%d"), "steps": table}
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
