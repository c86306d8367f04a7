"""`specd bench sweep`: throughput and latency vs concurrency, per speculation mode.

    specd bench sweep [--target HOST:PORT] [--workload code] [--concurrency 1,2,4,8,16]
                      [--modes off,on,auto,ngram] [--requests-per-cell 16] [--repeats 1]
                      [--waves 1]
                      [--peer hf] [--out bench/out/sweep]
    specd bench sweep --workload code,chat,retrieval --route code,chat,default ...  # mixed
    specd bench sweep --route code --modes off,auto,on@code_k2 ...  # a mode on another route

Against a running router (`--target`), or, without it, a drafter, verifier and router it
starts itself (`--model`, `--draft-model`). Each cell (mode x concurrency) sends a bounded
number of requests from `--concurrency` concurrent clients, streaming, and records per
request the time to first token, the time per output token after it, tokens, and the
speculation the router decided (reason, acceptance, mean accepted length). With
With several modes they take turns at every level, wave by wave: `--concurrency` requests
at once (one a client) in one mode, the same requests in the next, A B B A, each mode's time
the sum of its own waves' (at concurrency 1 a wave is one request): a drift of the
machine's speed then falls on every mode alike within seconds, which cells run one after
another cannot give. `--repeats R` runs each level R times (the modes' order reversed every
other run) and prints each mode's ratio to the first mode per run and merged.
Writes `sweep.json`, `sweep.md` (the table and the ratio lines it prints) and two PNG plots
(throughput, with the peers of the run beside specd, and TPOT p99 vs concurrency).
Modes "ngram" and "combined" are speculation on with drafts from elsewhere, as `specd
up` serves them (only when the sweep starts the services; against --target, sweep such a
cluster with `--modes on --label ngram`): "combined" swaps the drafter for that
`--proposer`; "ngram" runs last, with no drafter and the verifier restarted with a lookup
of its own. `--peer hf` also runs transformers' generate
(plain, assisted with the same draft model, prompt lookup) on the same prompts at
concurrency 1 and reports each mode's ratio to it. A mixed workload (`--workload a,b`,
`--route ra,rb`: one route per workload) interleaves the workloads' conversations, each
sent on its workload's route, and each cell also reports every route's share. A mode
written `mode@route` sends all of its cells' requests on that route instead (`auto` with
the route's k as its cap beside `on` at each fixed k, one route per k, in one run).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import anyio
import grpc
from tqdm import tqdm

from bench import flags
from bench.prompts import WARM_UP_TOKENS, load_requests
from bench.sweep_peers import add_peer
from bench.sweep_report import ms, summarise, summary, write_outputs
from protos.specd.v1 import router_pb2_grpc
from router.client import build_request

WARM_UP = [{"role": "user", "content": "Write a Python function that reverses a string."}]

# modes that are "on" with drafts from another proposer than the drafter's model, in the
# order they run (ngram stops the drafter)
SWAPPED = ("combined", "ngram")


async def stream_one(stub, messages, mode: str, max_new: int, route: str = "") -> dict:
    """One request streamed: `messages` a chat's, or a raw prompt's text."""
    start = time.perf_counter()
    first, tokens, final = None, 0, None
    given = {"prompt": messages} if isinstance(messages, str) else {"messages": messages}
    request = build_request(**given, max_new_tokens=max_new, speculation=mode, route=route)
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


async def drive(one, items, concurrency: int, requests: int, tick=None):
    """`requests` calls of `one(item)` from `concurrency` concurrent clients (one anyio
    task group: a client that fails cancels the others), cycling through the items (the
    conversations, or their indices); returns their results and the wall time. `tick(1)`
    after each (a tqdm bar's `update`)."""
    pending = iter([items[i % len(items)] for i in range(requests)])
    results: list[dict] = []

    async def client():
        for item in pending:  # shared: each item goes to one client
            results.append(await one(item))
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
    routes: list[str] | None = None,
) -> tuple[list[dict], float]:
    """One cell's per-request results and its wall time (bench/sweep_report.py sums up).
    `routes[i]`: conversation i's route (None: the default route for all)."""
    async with grpc.aio.insecure_channel(address) as channel:
        one = _sender(router_pb2_grpc.GenerationStub(channel), conversations, mode, routes, max_new)
        return await drive(one, range(len(conversations)), concurrency, requests, tick)


def _sender(stub, conversations, speculation: str, routes: list[str] | None, max_new: int):
    """`one(i)`: conversation i streamed on its route (`routes[i]`, else the default), its
    result tagged with the route."""

    async def one(i: int) -> dict:
        route = routes[i] if routes else ""
        result = await stream_one(stub, conversations[i], speculation, max_new, route)
        return {**result, "route": route}

    return one


def run_order(modes: list[str], levels: list[int], repeats: int) -> list[tuple[list[str], int]]:
    """The cells in the order they run: the modes that run each and its concurrency. With
    several modes every cell runs all of them, taking turns wave by wave (`run_turns`),
    their order reversed every other repeat; one mode runs its levels in turn."""
    return [(modes[::-1] if r % 2 else modes, c) for c in levels for r in range(repeats)]


async def run_turns(
    address: str,
    conversations,
    cells: list[tuple[str, list[str] | None]],
    concurrency: int,
    requests: int,
    max_new: int,
    tick=None,
) -> list[tuple[list[dict], float]]:
    """`requests` requests for each cell (speculation, routes), sent in waves of
    `concurrency` at once (one a client), each wave once per cell in turn, forwards then
    backwards (A B B A): each cell's results and the sum of its waves' wall times."""
    results: list[list[dict]] = [[] for _ in cells]
    walls = [0.0] * len(cells)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = router_pb2_grpc.GenerationStub(channel)
        for w, first in enumerate(range(0, requests, concurrency)):
            wave = [
                i % len(conversations) for i in range(first, min(first + concurrency, requests))
            ]
            for n in range(len(cells))[:: -1 if w % 2 else 1]:
                one = _sender(stub, conversations, *cells[n], max_new)
                done, wall = await drive(one, wave, concurrency, len(wave), tick)
                results[n] += done
                walls[n] += wall
    return list(zip(results, walls, strict=True))


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
    routes: list[str] | None = None,
    repeats: int = 1,
    waves: int = 1,
) -> dict:
    """Every (mode, concurrency) cell, each run `repeats` times in `run_order`, sending
    `requests` requests or `waves` waves of `c`, whichever is more; a cell's runs merge
    into one summary (tokens over wall time) that lists each run's tok/s, and with several
    routes each route's own summary over the same wall time."""

    def cell_args(mode: str) -> tuple[str, list[str] | None]:
        speculation, _, route = mode.partition("@")  # "on@code_k2": that mode on that route
        return speculation, [route] * len(conversations) if route else routes

    for mode in modes:
        speculation, cell_routes = cell_args(mode)
        # untimed first: the services' first forwards page the weights in and build
        # kernels; then every conversation once, so each cell finds the prompts in the
        # prefix caches (the verifier's, and the drafter's where the mode drafts) as every
        # other cell does: without it the first cell to send a prompt pays its prefill
        # and the others do not (llama-server gets the same, bench/llamacpp.py). `auto`
        # warms up as `on`: it decides a few-token request plain, so its drafter would
        # meet each prompt first in a timed cell
        warm = [WARM_UP, *conversations]
        warm_routes = None if cell_routes is None else [cell_routes[0], *cell_routes]
        asks = "on" if speculation == "auto" else speculation
        asyncio.run(run_cell(address, warm, asks, 1, len(warm), WARM_UP_TOKENS, None, warm_routes))
    runs: dict[tuple[str, int], list[tuple[list[dict], float]]] = {}
    for cell_modes, c in run_order(list(modes), list(levels), repeats):
        n = max(requests, waves * c)
        name = label or "+".join(cell_modes)
        bar = (
            tqdm(total=n * len(cell_modes), desc=f"{name:<6} c={c:<3}", leave=False)
            if bars
            else None
        )
        tick = bar.update if bar is not None else None
        args = [cell_args(mode) for mode in cell_modes]
        if len(args) > 1:
            turns = run_turns(address, conversations, args, c, n, max_new, tick)
            done = asyncio.run(turns)
        else:
            cell = run_cell(address, conversations, args[0][0], c, n, max_new, tick, args[0][1])
            done = [asyncio.run(cell)]
        if bar is not None:
            bar.close()
        for mode, (results, wall) in zip(cell_modes, done, strict=True):
            runs.setdefault((mode, c), []).append((results, wall))
            run = summarise(results, wall)
            progress(
                f"  {label or mode:<6} c={c:<3} {run['tokens_per_s']:7.2f} tok/s  "
                f"TPOT p99 {ms(run['tpot_p99'])}  reasons {run['reasons']}"
            )
    cells = []
    for mode in modes:
        for c in levels:
            done = runs[(mode, c)]
            results, wall = [r for rs, _ in done for r in rs], sum(w for _, w in done)
            cell = summarise(results, wall)
            cell.update(mode=label or mode, concurrency=c)
            if len(set(routes or [])) > 1 and "@" not in mode:
                cell["routes"] = {
                    route: summarise([r for r in results if r["route"] == route], wall)
                    for route in dict.fromkeys(routes)
                }
            if repeats > 1:
                cell["runs_tokens_per_s"] = [summarise(*run)["tokens_per_s"] for run in done]
            cells.append(cell)
    route = ",".join(dict.fromkeys(routes)) if routes else ""
    return {"target": address, "route": route, "max_new_tokens": max_new, "cells": cells}


def mix(workloads: list[list], routes: list[str]) -> tuple[list, list[str]]:
    """Interleave the workloads' conversations (a, b, c, a, b, c, ...: any prefix of the
    list holds them in proportion), each with its workload's route."""
    mixed = []
    for i in range(max(len(w) for w in workloads)):
        mixed += [(w[i], r) for w, r in zip(workloads, routes, strict=True) if i < len(w)]
    return [m for m, _ in mixed], [r for _, r in mixed]


def add_service_args(p: argparse.ArgumentParser) -> None:
    """What every bench that can start its own services takes."""
    p.add_argument("--target", default="", help="a running router (default: start services)")
    p.add_argument(
        "--model", default="default-target", help=f"without --target, the target: {flags.MODEL}"
    )
    p.add_argument(
        "--draft-model", default="default-draft", help=f"and the draft model: {flags.MODEL}"
    )
    p.add_argument("--dtype", default="auto", help=f"and both models' {flags.DTYPE}")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specd bench sweep", description=__doc__.split("\n")[0])
    add_service_args(p)
    p.add_argument(
        "--drafter-args",
        default="",
        help='extra `specd serve drafter` flags, e.g. "--weights int8"',
    )
    p.add_argument("--workload", default="code", help=flags.workload(several=True))
    p.add_argument(
        "--route", default="", help="the requests' route (default: default); one per workload"
    )
    p.add_argument("--concurrency", default="1,2,4,8,16", help=flags.CONCURRENCY)
    p.add_argument(
        "--modes",
        default="off,on,auto,ngram",
        help="the requests' speculation (off, on, auto), ngram or combined (on, with the "
        "drafter swapped for that proposer), or MODE@ROUTE; comma-separated (default: "
        "%(default)s)",
    )
    p.add_argument("--label", default="", help="name the mode column (e.g. ngram)")
    p.add_argument(
        "--requests-per-cell", type=int, default=16, help="requests a cell sends (%(default)s)"
    )
    p.add_argument(
        "--waves",
        type=int,
        default=1,
        help="at least this many waves a cell (a wave: one request from each of the c "
        "clients), so that a cell at a high concurrency sends more than "
        "--requests-per-cell; a run of one or two waves reads the machine's speed over a few "
        "seconds only (%(default)s)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run each cell this many times, the modes' order reversed every other time (the "
        "modes always take turns wave by wave: c requests at once in each, A B B A); use an "
        "even count to compare modes on a machine whose speed drifts (%(default)s)",
    )
    p.add_argument("--max-new-tokens", type=int, default=128, help=flags.MAX_NEW_TOKENS)
    p.add_argument(
        "--peer",
        choices=["none", "hf", "llamacpp"],
        default="none",
        help="also run transformers' generate (hf) or llama-server (llamacpp) on the same "
        "prompts, and give each mode's ratio to it (default: %(default)s)",
    )
    p.add_argument(
        "--peer-variants",
        default="llamacpp,llamacpp-draft,llamacpp-ngram",
        help="with --peer llamacpp: which llama-server set-ups (bench/llamacpp.py; %(default)s)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument(
        "--out",
        default="bench/out/sweep",
        help="folder for the JSON, markdown and plots (%(default)s)",
    )
    return p


def _specd_cells(args, modes: list[str], run: dict) -> dict:
    """Every (mode, concurrency) cell through specd: a running router (--target) or
    services started here (then ngram and combined draw their drafts as the module says)."""
    if args.target:
        return sweep(args.target, modes=modes, label=args.label, **run)
    from launcher.processes import lookup_in_verifier, replace_drafter, start_services

    logs = Path(tempfile.mkdtemp(prefix="specd-sweep-"))
    services = start_services(
        args.model, args.draft_model, args.dtype, logs, drafter_flags=args.drafter_args.split()
    )
    address = services["router"].address
    try:
        report = sweep(address, modes=[m for m in modes if m not in SWAPPED], **run)
        for proposer in [m for m in SWAPPED if m in modes]:
            if proposer == "ngram":
                lookup_in_verifier(services, logs)
            else:
                replace_drafter(services, args.draft_model, args.dtype, proposer, logs)
            report["cells"] += sweep(address, modes=["on"], label=proposer, **run)["cells"]
    finally:
        for role in ("router", "verifier", "drafter"):
            services[role].stop()
        print(f"service logs: {logs}")
    return report


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",")]
    if args.target and set(SWAPPED) & set(modes):
        p.error("modes ngram and combined need the sweep to start the services")
    workloads = args.workload.split(",")
    route_names = args.route.split(",") if args.route else [""] * len(workloads)
    if len(route_names) == 1:
        route_names *= len(workloads)
    if len(route_names) != len(workloads):
        p.error("--route: one route, or one per workload")
    conversations, routes = mix([load_requests(w) for w in workloads], route_names)
    run = dict(
        conversations=conversations,
        levels=[int(x) for x in args.concurrency.split(",")],
        requests=args.requests_per_cell,
        max_new=args.max_new_tokens,
        bars=not args.no_progress,
        routes=routes if any(routes) else None,
        repeats=args.repeats,
        waves=args.waves,
    )
    if args.repeats < 1 or args.waves < 1:
        p.error("--repeats and --waves must be at least 1")
    report = _specd_cells(args, modes, run)
    add_peer(report, args, run)
    for path in write_outputs(report, Path(args.out)):
        print(path)
    print(summary(report), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
