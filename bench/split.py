"""`specd bench split`: what the gRPC split costs — the router (drafter, verifier and
router as separate processes) vs the in-process engine, same workload, one run.

    specd bench split --workload code --mode on   [--address HOST:PORT]

Without --address it starts `specd up` itself (and stops it afterwards). Concurrency 1,
greedy. Speculation `on` uses the default policy's k for both sides. The in-process engine
is loaded beside the idle cluster and the prompts alternate between the two sides.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

from bench import flags
from bench.prompts import load_items
from bench.speculative import generate_one
from router.policy import RoutePolicy

ROUTER = "127.0.0.1:50051"


def _messages(workload: str, limit: int) -> list[list[dict]]:
    return [it["messages"] for it in load_items(workload)][: limit or None]


def _router_one(client, messages, mode: str, max_new: int):
    r = client.generate(messages=messages, max_new_tokens=max_new, speculation=mode)
    return list(r.token_ids), r.speculation.reason


def _engine_one(engine, ids, k: int, max_new: int):
    return generate_one(engine, ids, k, max_new), ""


def _in_process_engine(mode: str):
    """The verifier's engine with the drafter's proposer in one process, each built from
    its service's default config (weights, trimmed vocabulary, combined drafting)."""
    from drafter_service.server import build_proposer
    from specd.config import DrafterConfig, EngineConfig
    from specd.models.loader import eos_token_ids, load_config, load_model, load_tokenizer
    from specd.models.resolve import resolve
    from verifier_service.engine import Engine

    folder = resolve("default-target")
    proposer = build_proposer(DrafterConfig())[0] if mode == "on" else None
    engine = Engine(
        load_model(folder, weights="auto"),
        EngineConfig(),
        proposer,
        eos_token_ids(folder, load_config(folder)),
    )
    return engine, load_tokenizer(folder)


def interleaved(address: str, conversations, mode: str, max_new: int, k: int) -> dict:
    """Each prompt through the router and through the in-process engine, back to back
    (alternating which goes first), so drift on a shared machine hits both alike."""
    from router.client import SpecdClient

    engine, tok = _in_process_engine(mode)
    local_k = k if mode == "on" else 0
    sides = {name: {"tokens": 0, "seconds": 0.0, "outputs": []} for name in ("split", "local")}
    reasons = set()
    with SpecdClient(address) as client:
        client.generate(messages=[{"role": "user", "content": "hi"}], max_new_tokens=4)
        _engine_one(engine, tok.encode("hi"), local_k, 4)  # warm both
        for i, messages in enumerate(conversations):
            enc = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            ids = list(enc["input_ids"] if hasattr(enc, "keys") else enc)
            runs = {
                "split": lambda m=messages: _router_one(client, m, mode, max_new),
                "local": lambda ids=ids: _engine_one(engine, ids, local_k, max_new),
            }
            for name in ("split", "local") if i % 2 == 0 else ("local", "split"):
                t0 = time.perf_counter()
                out, reason = runs[name]()
                sides[name]["seconds"] += time.perf_counter() - t0
                sides[name]["tokens"] += len(out)
                sides[name]["outputs"].append(out)
                reasons.add(reason)
    for side in sides.values():
        side["tok_per_s"] = side["tokens"] / side["seconds"]
    sides["split"]["reasons"] = sorted(reasons - {""})
    return sides


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specd bench split", description=__doc__.split("\n")[0])
    p.add_argument("--workload", default="code", help=flags.workload())
    p.add_argument("--limit", type=int, default=8, help="its first N prompts (%(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=128, help=flags.MAX_NEW_TOKENS)
    p.add_argument("--mode", choices=["on", "off"], default="on", help="speculation (%(default)s)")
    p.add_argument("--address", default="", help="a running router (default: start specd up)")
    p.add_argument("--json", help="also write the report here")
    return p


@contextlib.contextmanager
def _router(address: str):
    """`address`, or a `specd up` started here (stopped on exit) when it is empty."""
    if address:
        yield address
        return
    cluster = subprocess.Popen(
        [sys.executable, "-m", "launcher", "up"], stdout=subprocess.PIPE, text=True
    )
    try:
        if not any("specd is up" in line for line in cluster.stdout):
            raise SystemExit("specd up did not come up")
        yield ROUTER
    finally:
        cluster.terminate()
        cluster.wait(30)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    conversations = _messages(args.workload, args.limit)
    k = RoutePolicy().num_draft_tokens
    with _router(args.address) as address:
        sides = interleaved(address, conversations, args.mode, args.max_new_tokens, k)
    split, local = sides["split"], sides["local"]
    ratio = split["tok_per_s"] / local["tok_per_s"]
    same = split["outputs"] == local["outputs"]
    print(f"{args.workload}, speculation {args.mode} (k={k}), {len(conversations)} prompts:")
    print(f"  through the router : {split['tok_per_s']:.2f} tok/s  reasons {split['reasons']}")
    print(f"  in-process engine  : {local['tok_per_s']:.2f} tok/s")
    print(f"  split / in-process : {ratio:.3f}  (identical outputs: {same})")
    if args.json:
        report = {"split": split, "in_process": local, "ratio": ratio, "identical": same}
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
