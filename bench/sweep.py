"""`specd bench sweep`: throughput and latency vs concurrency, per speculation mode.

    specd bench sweep [--target HOST:PORT] [--workload code] [--concurrency 1,2,4,8,16]
                      [--modes off,on,auto,ngram] [--requests-per-cell 16] [--peer hf]
                      [--out bench/out/sweep]

Against a running router (`--target`), or, without it, a drafter, verifier and router it
starts itself (`--model`, `--draft-model`). Each cell (mode x concurrency) sends a bounded
number of requests from `--concurrency` concurrent clients, streaming, and records per
request the time to first token, the time per output token after it, tokens, and the
speculation the router decided (reason, acceptance, mean accepted length).
Writes `sweep.json`, `sweep.md` and two PNG plots (throughput and TPOT p99 vs concurrency).
Modes "ngram" and "combined" are speculation on with the drafter swapped for that
`--proposer` (only when the sweep starts the services; against --target, sweep such a
cluster with `--modes on --label ngram`). `--peer hf` also runs transformers' generate
(plain, assisted with the same draft model, prompt lookup) on the same prompts at
concurrency 1 and reports each mode's ratio to it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

import anyio
import grpc
from tqdm import tqdm

from bench.speculative import load_items
from protos.specd.v1 import router_pb2_grpc
from router.client import build_request

WARM_UP = [{"role": "user", "content": "Write a Python function that reverses a string."}]

# modes that are "on" with the drafter process swapped for another proposer
SWAPPED = {"ngram", "combined"}


def load_conversations(workload: str) -> list[list[dict]]:
    return [
        it["messages"] if "messages" in it else [{"role": "user", "content": it["prompt"]}]
        for it in load_items(workload)
    ]


async def _one(stub, messages, mode: str, max_new: int, route: str = "") -> dict:
    start = time.perf_counter()
    first, tokens, final = None, 0, None
    request = build_request(
        messages=messages, max_new_tokens=max_new, speculation=mode, route=route
    )
    async for msg in stub.GenerateStream(request):
        if msg.token_ids and first is None:
            first = time.perf_counter()
        tokens += len(msg.token_ids)
        if msg.finish_reason:
            final = msg
    end = time.perf_counter()
    spec = final.speculation
    return {
        "ttft": (first or end) - start,
        "tpot": (end - first) / (tokens - 1) if first and tokens > 1 else None,
        "tokens": tokens,
        "reason": spec.reason,
        "drafted": spec.drafted,
        "accepted": spec.accepted,
        "rounds": spec.rounds,
    }


async def drive(one, conversations, concurrency: int, requests: int, tick=None):
    """`requests` calls of `one(messages)` from `concurrency` concurrent clients (one anyio
    task group: a client that fails cancels the others), cycling through the
    conversations; returns their results and the wall time. `tick(1)` after each (a tqdm
    bar's `update`)."""
    pending = iter([conversations[i % len(conversations)] for i in range(requests)])
    results: list[dict] = []

    async def client():
        for messages in pending:  # shared: each conversation goes to one client
            results.append(await one(messages))
            if tick is not None:
                tick(1)

    start = time.perf_counter()
    async with anyio.create_task_group() as clients:
        for _ in range(concurrency):
            clients.start_soon(client)
    return results, time.perf_counter() - start


async def run_cell(
    address: str,
    conversations,
    mode: str,
    concurrency: int,
    requests: int,
    max_new: int,
    tick=None,
    route: str = "",
) -> dict:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = router_pb2_grpc.GenerationStub(channel)
        results, wall = await drive(
            lambda m: _one(stub, m, mode, max_new, route),
            conversations,
            concurrency,
            requests,
            tick,
        )
    return summarise(results, wall)


def _pct(values: list[float], q: float) -> float | None:
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
        "ttft_p50": _pct(ttft, 0.5),
        "ttft_p99": _pct(ttft, 0.99),
        "tpot_p50": _pct(tpot, 0.5),
        "tpot_p99": _pct(tpot, 0.99),
        "tpot_mean": statistics.fmean(tpot) if tpot else None,
        "acceptance": accepted / drafted if drafted else None,
        "mean_accepted_length": (accepted + rounds) / rounds if rounds else None,
        "reasons": dict(Counter(r["reason"] for r in results)),
    }


def sweep(
    address: str,
    conversations,
    modes,
    levels,
    requests: int,
    max_new: int,
    label: str = "",
    progress=print,
    bars: bool = False,
    route: str = "",
) -> dict:
    cells = []
    for mode in modes:
        # one untimed request first: the services' first forwards page the weights in and
        # build kernels (llama-server gets the same warm-up, bench/llamacpp.py)
        asyncio.run(run_cell(address, [WARM_UP], mode, 1, 1, 16, route=route))
        for c in levels:
            n = max(requests, c)
            name = label or mode
            bar = tqdm(total=n, desc=f"{name:<6} c={c:<3}", leave=False) if bars else None
            tick = bar.update if bar is not None else None
            cell = asyncio.run(run_cell(address, conversations, mode, c, n, max_new, tick, route))
            if bar is not None:
                bar.close()
            cell.update(mode=name, concurrency=c)
            cells.append(cell)
            progress(
                f"  {cell['mode']:<6} c={c:<3} {cell['tokens_per_s']:7.2f} tok/s  "
                f"TPOT p99 {_ms(cell['tpot_p99'])}  reasons {cell['reasons']}"
            )
    return {"target": address, "route": route, "max_new_tokens": max_new, "cells": cells}


def _ms(x) -> str:
    return "-" if x is None else f"{x * 1000:.0f} ms"


def to_markdown(report: dict) -> str:
    rows = [
        "| mode | concurrency | tok/s | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | "
        "acceptance | mean accepted length | decisions |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in report["cells"]:
        acc = "-" if c["acceptance"] is None else f"{c['acceptance']:.0%}"
        mal = "-" if c["mean_accepted_length"] is None else f"{c['mean_accepted_length']:.2f}"
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(c["reasons"].items()))
        rows.append(
            f"| {c['mode']} | {c['concurrency']} | {c['tokens_per_s']:.2f} | "
            f"{_ms(c['ttft_p50'])} | {_ms(c['ttft_p99'])} | {_ms(c['tpot_p50'])} | "
            f"{_ms(c['tpot_p99'])} | {acc} | {mal} | {reasons} |"
        )
    return "\n".join(rows) + "\n"


def plot(report: dict, out: Path) -> list[Path]:
    try:
        import matplotlib
    except ImportError:  # an optional extra: the JSON and markdown are the results
        print("plots skipped: matplotlib is missing (pip install 'specd[bench]')")
        return []

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for key, title, unit in (
        ("tokens_per_s", "Throughput", "tokens/s"),
        ("tpot_p99", "TPOT p99", "seconds"),
    ):
        fig, ax = plt.subplots(figsize=(6, 4))
        for mode in dict.fromkeys(c["mode"] for c in report["cells"]):
            cells = [c for c in report["cells"] if c["mode"] == mode and c[key] is not None]
            ax.plot(
                [c["concurrency"] for c in cells], [c[key] for c in cells], marker="o", label=mode
            )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel(unit)
        ax.set_title(f"{title} vs concurrency")
        ax.legend()
        ax.grid(alpha=0.3)
        path = out / f"sweep_{key}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def write_outputs(report: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps(report, indent=1))
    (out / "sweep.md").write_text(to_markdown(report))
    return [out / "sweep.json", out / "sweep.md", *plot(report, out)]


def hf_peer(model: str, draft_model: str, conversations, max_new: int, dtype_name: str) -> dict:
    """transformers' generate on the same pair and prompts (concurrency 1, greedy, bf16
    where the CPU has it, like the services)."""
    import torch

    from bench.speculative import run_hf
    from specd.models.args import parse_dtype
    from specd.models.loader import load_tokenizer
    from specd.models.resolve import resolve

    folder, draft = resolve(model), resolve(draft_model)
    tok = load_tokenizer(folder)
    prompts = []
    for messages in conversations:
        enc = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        prompts.append(list(enc["input_ids"] if hasattr(enc, "keys") else enc))
    dtype = parse_dtype(dtype_name, torch.device("cpu"))
    results = run_hf(folder, draft, prompts, max_new, dtype)
    return {name: {k: v for k, v in r.items() if k != "outputs"} for name, r in results.items()}


def peer_ratios(report: dict) -> list[str]:
    """Each mode's concurrency-1 tokens/s over each transformers mode's."""
    lines = []
    for cell in (c for c in report["cells"] if c["concurrency"] == 1):
        for name, peer in report["peer"].items():
            ratio = cell["tokens_per_s"] / peer["tok_per_s"]
            lines.append(f"specd {cell['mode']} (c=1) / {name}: {ratio:.2f}x")
    return lines


def llamacpp_ratios(report: dict) -> list[str]:
    """Each specd cell's tokens/s over each llama-server variant's at the same concurrency
    (measured in the same run)."""
    lines = []
    for name, cells in report["llamacpp"].items():
        if isinstance(cells, dict):
            lines.append(f"{name}: {cells['error']}")
            continue
        peer = {c["concurrency"]: c["tokens_per_s"] for c in cells}
        for cell in report["cells"]:
            if cell["concurrency"] in peer:
                ratio = cell["tokens_per_s"] / peer[cell["concurrency"]]
                lines.append(
                    f"specd {cell['mode']} (c={cell['concurrency']}, "
                    f"{cell['tokens_per_s']:.1f} tok/s) / {name} "
                    f"({peer[cell['concurrency']]:.1f} tok/s): {ratio:.2f}x"
                )
    return lines


def add_service_args(p: argparse.ArgumentParser) -> None:
    """What every bench that can start its own services takes."""
    p.add_argument("--target", default="", help="a running router (default: start services)")
    p.add_argument("--model", default="default-target")
    p.add_argument("--draft-model", default="default-draft")
    p.add_argument("--dtype", default="auto")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specd bench sweep", description=__doc__.split("\n")[0])
    add_service_args(p)
    p.add_argument(
        "--drafter-args",
        default="",
        help='extra `specd serve drafter` flags, e.g. "--weights int8"',
    )
    p.add_argument("--workload", default="code")
    p.add_argument("--route", default="", help="the requests' route (default: default)")
    p.add_argument("--concurrency", default="1,2,4,8,16")
    p.add_argument("--modes", default="off,on,auto,ngram")
    p.add_argument("--label", default="", help="name the mode column (e.g. ngram)")
    p.add_argument("--requests-per-cell", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--peer", choices=["none", "hf", "llamacpp"], default="none")
    p.add_argument(
        "--peer-variants",
        default="llamacpp,llamacpp-draft,llamacpp-ngram",
        help="with --peer llamacpp: which llama-server set-ups (bench/llamacpp.py)",
    )
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--out", default="bench/out/sweep")
    return p


def _specd_cells(args, modes: list[str], run: dict) -> dict:
    """Every (mode, concurrency) cell through specd: a running router (--target) or
    services started here (then ngram/combined swap the drafter between modes)."""
    if args.target:
        return sweep(args.target, modes=modes, label=args.label, **run)
    from specd.processes import replace_drafter, start_services

    logs = Path(tempfile.mkdtemp(prefix="specd-sweep-"))
    services = start_services(
        args.model, args.draft_model, args.dtype, logs, drafter_flags=args.drafter_args.split()
    )
    address = services["router"].address
    try:
        report = sweep(address, modes=[m for m in modes if m not in SWAPPED], **run)
        for proposer in [m for m in modes if m in SWAPPED]:
            replace_drafter(services, args.draft_model, args.dtype, proposer, logs)
            report["cells"] += sweep(address, modes=["on"], label=proposer, **run)["cells"]
    finally:
        for role in ("router", "verifier", "drafter"):
            services[role].stop()
    return report


def _add_peer(report: dict, args, run: dict) -> None:
    conversations = run["conversations"]
    if args.peer == "hf":
        n = min(len(conversations), args.requests_per_cell)
        report["peer"] = hf_peer(
            args.model, args.draft_model, conversations[:n], run["max_new"], args.dtype
        )
        report["peer_ratios"] = peer_ratios(report)
    if args.peer == "llamacpp":
        from bench.llamacpp import llamacpp_peer

        report["llamacpp"] = llamacpp_peer(
            args.model,
            args.draft_model,
            conversations,
            run["levels"],
            args.requests_per_cell,
            run["max_new"],
            tempfile.mkdtemp(prefix="specd-peer-"),
            [n.strip() for n in args.peer_variants.split(",")],
        )
        report["peer_ratios"] = llamacpp_ratios(report)


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",")]
    if args.target and SWAPPED & set(modes):
        p.error("modes ngram and combined need the sweep to start the services")
    run = dict(
        conversations=load_conversations(args.workload),
        levels=[int(x) for x in args.concurrency.split(",")],
        requests=args.requests_per_cell,
        max_new=args.max_new_tokens,
        bars=not args.no_progress,
        route=args.route,
    )
    report = _specd_cells(args, modes, run)
    _add_peer(report, args, run)
    for path in write_outputs(report, Path(args.out)):
        print(path)
    print(to_markdown(report))
    for line in report.get("peer_ratios", []):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
