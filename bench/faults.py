"""`specd bench faults`: SIGKILL a drafter, then a verifier, under load in `specd up`.

    specd bench faults                                  # the default pair, code prompts
    specd bench faults --target small --draft small --requests 8 --tokens 128

Starts `specd up --verifiers 2` as users run it, then:
1. `--requests` concurrent streams with speculation on; once every stream has produced a
   token, SIGKILL the drafter. Counts failed requests, and times until the drafter is
   ready again and until a request drafts again.
2. `--requests` concurrent unary requests; SIGKILL one verifier while they run. Counts
   failed requests and times until the verifier is ready again.
Prints one JSON report; exit status 0 when no request failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from bench import flags
from launcher.processes import free_port
from router.client import SpecdClient

PROMPTS = [
    "Write a Python function that merges two sorted lists.",
    "Write a Python class for an LRU cache with get and put.",
    "Write a function that parses an ISO 8601 date string in Python.",
    "Write a Python function that returns the n-th prime number.",
    "Write a binary search over a sorted list in Python.",
    "Write a Python generator that yields the Fibonacci numbers.",
    "Write a Python function that flattens a nested list.",
    "Write a Python function that checks whether a string is a palindrome.",
]


class Up:
    """`specd up` as a child process, its output collected line by line in a thread."""

    def __init__(self, *flags: str):
        cmd = [sys.executable, "-m", "launcher", "up", *flags]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def text(self, after: int = 0) -> str:
        return "".join(self.lines[after:])

    def wait_for(self, pattern: str, timeout: float, after: int = 0) -> re.Match:
        """The first match of `pattern` in the output from line `after` on."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = re.search(pattern, self.text(after))
            if found:
                return found
            if self.proc.poll() is not None:
                raise RuntimeError(f"specd up exited:\n{self.text()[-3000:]}")
            time.sleep(0.1)
        raise TimeoutError(f"no {pattern!r} after {timeout} s:\n{self.text()[-3000:]}")

    def pid(self, role: str, after: int = 0, timeout: float = 60) -> int:
        """The pid of `role`'s process from its (next) ready line."""
        return int(self.wait_for(rf"{role} ready[a-z ]* on \S+ \(pid (\d+)\)", timeout, after)[1])

    def stop(self, timeout: float = 90) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)


def _outcome(fn):
    try:
        return fn()
    except grpc.RpcError as exc:
        return exc.code().name


def kill_drafter(up: Up, client: SpecdClient, n: int, tokens: int) -> dict:
    drafter = up.pid("drafter")
    first: set[int] = set()

    def stream(i: int) -> int:
        got = 0
        for msg in client.stream(
            PROMPTS[i % len(PROMPTS)], max_new_tokens=tokens, route="code", speculation="on"
        ):
            first.add(i)
            got += len(msg.token_ids)
        return got

    with ThreadPoolExecutor(n + 1) as pool:
        futures = [pool.submit(_outcome, lambda i=i: stream(i)) for i in range(n)]
        while len(first) < n and not all(f.done() for f in futures):
            time.sleep(0.01)
        mark = len(up.lines)
        os.kill(drafter, signal.SIGKILL)
        killed = time.monotonic()
        ready = pool.submit(_ready_after, up, "drafter", mark, killed)
        while True:  # drafting again once a verifier has reconnected (streams still run)
            r = client.generate(PROMPTS[0], max_new_tokens=16, route="code", speculation="on")
            if r.speculation.drafted > 0 or time.monotonic() - killed > 120:
                break
        drafting_s = time.monotonic() - killed
        outcomes = [f.result() for f in futures]
    return {
        "fault": "SIGKILL drafter",
        "requests": n,
        "failed": sum(not isinstance(o, int) for o in outcomes),
        "outcomes": outcomes,
        "drafter_ready_again_s": ready.result(),
        "drafting_again_s": round(drafting_s, 1),
    }


def _ready_after(up: Up, role: str, mark: int, since: float) -> float:
    up.pid(role, mark, timeout=300)
    return round(time.monotonic() - since, 1)


def kill_verifier(up: Up, client: SpecdClient, n: int, tokens: int) -> dict:
    verifier = up.pid("verifier")
    mark = len(up.lines)

    def unary(i: int) -> int:
        prompt = PROMPTS[i % len(PROMPTS)]
        return len(client.generate(prompt, max_new_tokens=tokens, route="code").token_ids)

    with ThreadPoolExecutor(n + 1) as pool:
        futures = [pool.submit(_outcome, lambda i=i: unary(i)) for i in range(n)]
        time.sleep(2.0)  # every request is running
        os.kill(verifier, signal.SIGKILL)
        killed = time.monotonic()
        ready = pool.submit(_ready_after, up, "verifier", mark, killed)
        outcomes = [f.result() for f in futures]
        served_s = time.monotonic() - killed
        ready_s = ready.result()
    return {
        "fault": "SIGKILL one of two verifiers",
        "requests": n,
        "failed": sum(not isinstance(o, int) for o in outcomes),
        "outcomes": outcomes,
        "retried_elsewhere": up.text(mark).count("trying another"),
        "all_answered_s": round(served_s, 1),
        "verifier_ready_again_s": ready_s,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specd bench faults", description=__doc__.split("\n")[0])
    p.add_argument("--target", default="default-target", help=f"the target: {flags.MODEL}")
    p.add_argument("--draft", default="default-draft", help=f"the draft model: {flags.MODEL}")
    p.add_argument(
        "--requests", type=int, default=8, help="concurrent requests a fault hits (%(default)s)"
    )
    p.add_argument("--tokens", type=int, default=128, help=flags.MAX_NEW_TOKENS)
    p.add_argument("--json", help="also write the report here")
    args = p.parse_args(argv)
    ports = {role: free_port() for role in ("router", "verifier", "drafter")}
    up = Up(
        *("--target", args.target, "--draft", args.draft, "--verifiers", "2"),
        *("--router-port", str(ports["router"]), "--drafter-port", str(ports["drafter"])),
        *("--verifier-port", str(ports["verifier"]), "--http-port", str(free_port())),
    )
    try:
        up.wait_for("specd is up", 900)
        with SpecdClient(f"127.0.0.1:{ports['router']}") as client:
            report = [
                kill_drafter(up, client, args.requests, args.tokens),
                kill_verifier(up, client, args.requests, args.tokens),
            ]
    finally:
        code = up.stop()
    print(json.dumps({"reports": report, "specd_up_exit": code}, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if all(r["failed"] == 0 for r in report) and code == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
