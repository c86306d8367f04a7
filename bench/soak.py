"""`specd bench soak`: many mixed requests, then proof that nothing leaked.

    specd bench soak --requests 1000 --concurrency 8            # starts the default pair
    specd bench soak --model small --draft-model small          # any models / folders
    specd bench soak --target ROUTER --verifier VERIFIER        # a running cluster

The mix (seeded): routes (including an unknown one), greedy and sampled requests with
top-p / top-k, speculation on / off / auto, stop strings, streams the client cancels after
the first message, and deadlines too short to finish. Expected outcomes: OK; CANCELLED for
the cancels; OK or DEADLINE_EXCEEDED for the deadlines. Anything else is an unexpected
error. Afterwards the verifier's KV blocks, running and waiting counts must return to 0
and (when it started the services) the drafter's sessions too, and each service's resident
memory may grow at most 10% between the end of warm-up (the first 10% of requests) and
the end. Exit status 0 only when all of that holds.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from bench import flags
from bench.soak_requests import EXPECTED, SoakRequest, mixed_requests, send
from launcher.processes import scrape, start_services, verifier_load

MAX_RSS_GROWTH = 0.10


@dataclass
class SoakResult:
    requests: int = 0
    outcomes: dict = field(default_factory=dict)  # "kind/STATUS" -> count
    unexpected: int = 0
    examples: list = field(default_factory=list)  # (kind, status, details) of the first 20
    seconds: float = 0.0
    drained: dict = field(default_factory=dict)  # verifier (and drafter) state afterwards
    rss: dict = field(default_factory=dict)  # role -> {"warm": bytes, "end": bytes, "growth"}

    def record(self, kind: str, code, details: str) -> None:
        key = f"{kind}/{code.name}"
        self.outcomes[key] = self.outcomes.get(key, 0) + 1
        if code not in EXPECTED[kind]:
            self.unexpected += 1
            if len(self.examples) < 20:
                self.examples.append((kind, code.name, details))

    @property
    def ok(self) -> bool:
        drained = all(v == 0 for v in self.drained.values())
        memory = all(r["growth"] < MAX_RSS_GROWTH for r in self.rss.values())
        return not self.unexpected and drained and memory


def run_soak(
    router: str,
    verifier: str,
    requests: list[SoakRequest],
    concurrency: int = 8,
    rss=None,  # role -> callable returning bytes, for services this process started
    drafter_metrics_port: int = 0,
    progress=None,
) -> SoakResult:
    from router.client import SpecdClient

    result = SoakResult(requests=len(requests))
    warm_at = max(1, len(requests) // 10)
    done, lock = 0, threading.Lock()
    warm: dict[str, int] = {}

    def one(req: SoakRequest) -> None:
        nonlocal done
        code, details = send(client, req)
        with lock:
            result.record(req.kind, code, details)
            done += 1
            if done == warm_at:
                warm.update({role: read() for role, read in (rss or {}).items()})
            if progress is not None:
                progress(1)

    started = time.perf_counter()
    with SpecdClient(router) as client, ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, requests))
    result.seconds = time.perf_counter() - started

    result.drained = _drained(verifier, drafter_metrics_port)
    for role, read in (rss or {}).items():
        end = read()
        result.rss[role] = {"warm": warm[role], "end": end, "growth": end / warm[role] - 1}
    return result


def _drained(verifier: str, drafter_metrics_port: int, wait_s: float = 10) -> dict[str, int]:
    """What is still held after the run: KV blocks, running and waiting sequences, drafter
    sessions. Cancelled and timed-out requests free theirs asynchronously: wait a moment."""
    deadline = time.monotonic() + wait_s
    while True:
        load = verifier_load(verifier)
        held = {"kv_blocks_used": load.kv_blocks_used, "running": load.running}
        held["waiting"] = load.waiting
        if drafter_metrics_port:
            held["drafter_sessions"] = int(scrape(drafter_metrics_port, "specd:drafter_sessions"))
        if all(v == 0 for v in held.values()) or time.monotonic() > deadline:
            return held
        time.sleep(0.2)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specd bench soak", description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=1000, help="requests in all (%(default)s)")
    p.add_argument("--concurrency", type=int, default=8, help="concurrent clients (%(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=32, help=flags.MAX_NEW_TOKENS)
    p.add_argument("--seed", type=int, default=0, help="the mix's (%(default)s)")
    p.add_argument("--target", default="", help="a running router (with --verifier)")
    p.add_argument("--verifier", default="", help="its verifier, to check the KV drained")
    p.add_argument("--model", default="default-target", help=f"without --target: {flags.MODEL}")
    p.add_argument("--draft-model", default="default-draft", help=f"the draft: {flags.MODEL}")
    p.add_argument("--dtype", default="auto", help=f"both models' {flags.DTYPE}")
    p.add_argument("--json", help="write the result here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _soak_started_services(args, requests, progress) -> SoakResult:
    """Start the three services here (their RSS and the drafter's sessions are checked)."""
    logs = Path(tempfile.mkdtemp(prefix="specd-soak-"))
    cluster = start_services(args.model, args.draft_model, args.dtype, logs)
    services = [cluster[r] for r in ("router", "verifier", "drafter")]
    try:
        return run_soak(
            cluster["router"].address,
            cluster["verifier"].address,
            requests,
            args.concurrency,
            {s.role: s.rss_bytes for s in services},
            cluster["drafter_metrics_port"],
            progress,
        )
    finally:
        for s in services:
            s.stop()
        print(f"service logs: {logs}")


def _report(result: SoakResult, concurrency: int) -> None:
    print(f"{result.requests} requests in {result.seconds:.1f}s, concurrency {concurrency}")
    for key, count in sorted(result.outcomes.items()):
        print(f"  {key:32s} {count}")
    print(f"unexpected errors: {result.unexpected}")
    for kind, code, details in result.examples:
        print(f"  {kind}: {code} {details}")
    print("after the run: " + ", ".join(f"{k} {v}" for k, v in result.drained.items()))
    for role, r in result.rss.items():
        print(
            f"  {role:9s} RSS {r['warm'] / 2**20:.0f} MiB after warm-up -> "
            f"{r['end'] / 2**20:.0f} MiB ({100 * r['growth']:+.1f}%)"
        )
    print("PASS" if result.ok else "FAIL")


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if bool(args.target) != bool(args.verifier):
        p.error("--target and --verifier go together")
    requests = mixed_requests(args.requests, args.seed, args.max_new_tokens)
    with tqdm(total=len(requests), desc="soak", disable=args.no_progress) as bar:
        if args.target:
            result = run_soak(
                args.target, args.verifier, requests, args.concurrency, None, 0, bar.update
            )
        else:
            result = _soak_started_services(args, requests, bar.update)
    _report(result, args.concurrency)
    if args.json:
        Path(args.json).write_text(json.dumps({**result.__dict__, "ok": result.ok}, indent=1))
    return 0 if result.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
