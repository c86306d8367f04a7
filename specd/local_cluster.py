"""`specd up`: drafter, verifier and router as child processes on localhost."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from specd.serving import check_health


def _spawn(role: str, *flags: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "specd.cli", "serve", role, *flags]
    return subprocess.Popen(cmd)


def run_local_cluster(args) -> int:
    from specd.models.resolve import resolve

    # fetch (and convert) missing models once, before three processes race for them
    resolve(args.target)
    resolve(args.draft)
    host = args.host
    drafter = f"{host}:{args.drafter_port}"
    verifier = f"{host}:{args.verifier_port}"
    router = f"{host}:{args.router_port}"
    children = {
        "drafter": _spawn(
            "drafter",
            "--host",
            host,
            "--port",
            str(args.drafter_port),
            "--model",
            args.draft,
            "--proposer",
            args.proposer,
        ),
        "verifier": _spawn(
            "verifier",
            "--host",
            host,
            "--port",
            str(args.verifier_port),
            "--model",
            args.target,
            "--drafter",
            drafter,
        ),
        "router": _spawn(
            "router",
            "--host",
            host,
            "--port",
            str(args.router_port),
            "--verifier",
            verifier,
            "--tokenizer",
            args.target,
            *(["--policy-file", args.policy_file] if args.policy_file else []),
        ),
    }
    stopping = False

    def stop(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    try:
        addresses = {"drafter": drafter, "verifier": verifier, "router": router}
        deadline = time.monotonic() + args.ready_timeout
        pending = dict(addresses)
        while pending and not stopping:
            for role, address in list(pending.items()):
                if children[role].poll() is not None:
                    print(
                        f"specd up: {role} exited with {children[role].returncode}", file=sys.stderr
                    )
                    return 1
                # the router is ready once its Generation service is (a verifier is up)
                service = "specd.v1.Generation" if role == "router" else ""
                if check_health(address, timeout=0.5, service=service):
                    print(f"specd up: {role} ready on {address}", flush=True)
                    del pending[role]
            if time.monotonic() > deadline:
                print(f"specd up: not ready in time: {sorted(pending)}", file=sys.stderr)
                return 1
            time.sleep(0.5)
        if not stopping:
            print(
                f"\nspecd is up: router on {router}\n  try: specd generate "
                f'--address {router} --stream "Write a Python function that reverses a '
                'string."\nCtrl-C stops all three.',
                flush=True,
            )
        while not stopping and all(p.poll() is None for p in children.values()):
            time.sleep(0.5)
        return 0 if stopping else 1
    finally:
        for p in children.values():
            if p.poll() is None:
                p.terminate()
        for p in children.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
