"""Speculation through the services on one GPU at a controlled acceptance: a verifier
process and a drafter process (gRPC between them, as deployed) on random weights of real
shapes, against plain decoding through the same verifier and against the same engine
in-process (bench.gpu.run measures that side in the same run).

Two pairs run side by side: one drafter proposes without a model (a lookup's cost), the
other behind the draft model's real forwards (bench.gpu.controlled). The client speaks
to each verifier directly (token ids in, as the router sends them): there is no
tokenizer for random weights, so the router's hop is left out.

    python -m bench.gpu.services drafter --port P --recorded F [--draft-shape S]
    python -m bench.gpu.services verifier --port P --drafter HOST:PORT [--shape S]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import torch

from bench.gpu.controlled import ControlledProposer
from bench.gpu.shapes import build
from protos.specd.v1 import verifier_pb2, verifier_pb2_grpc

HOST = "127.0.0.1"


def _drafter(args) -> None:
    from drafter_service.draft_model import DraftModelProposer
    from drafter_service.server import serve
    from specd.config import DrafterConfig

    data = json.loads(Path(args.recorded).read_text())
    recorded = {tuple(p): out for p, out in data["recorded"]}
    inner = None
    if args.draft_shape:
        _, draft = build(args.draft_shape, args.device, dtype(args.device), seed=1, draft=True)
        inner = DraftModelProposer(draft, num_blocks=4096)
    proposer = ControlledProposer(recorded, data["vocab"], args.acceptance, inner)
    config = DrafterConfig(host=HOST, port=args.port)
    asyncio.run(serve(config, built=(proposer, data["vocab"], "controlled")))


def _verifier(args) -> None:
    from specd.config import EngineConfig, VerifierConfig
    from verifier_service.drafter_client import RemoteProposer
    from verifier_service.engine import Engine
    from verifier_service.startup import serve

    _, target = build(args.shape, args.device, dtype(args.device))
    config = VerifierConfig(host=HOST, port=args.port, drafter=args.drafter)
    proposer = RemoteProposer(args.drafter, config.drafter_timeout_ms, 1000, None)
    # 32 sequences of up to 512 tokens (the c = 32 run's), as the in-process engine holds
    engine_config = EngineConfig(max_batch_size=32, num_blocks=32 * 512 // 16)
    engine = Engine(target, engine_config, proposer, eos_ids=set())
    asyncio.run(serve(config, engine=engine, model_name=args.shape))


def dtype(device: str) -> torch.dtype:
    return torch.bfloat16 if device.startswith("cuda") else torch.float32


def _wait_serving(address: str, deadline_s: float) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    end = time.monotonic() + deadline_s
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < end:
            with contextlib.suppress(grpc.RpcError):
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            time.sleep(0.5)
    raise TimeoutError(f"{address} not serving after {deadline_s} s")


def generate(address: str, prompts, new: int, k: int) -> dict:
    """Each prompt alone (c = 1) through a verifier: tok/s and the outputs."""
    outputs, tokens = [], 0
    with grpc.insecure_channel(address) as channel:
        stub = verifier_pb2_grpc.VerifierStub(channel)
        t0 = time.perf_counter()
        for p in prompts:
            request = verifier_pb2.VerifyGenerateRequest(
                prompt_ids=p, max_new_tokens=new, ignore_eos=True, num_draft_tokens=k
            )
            out = [t for reply in stub.Generate(request, timeout=300) for t in reply.token_ids]
            outputs.append(out)
            tokens += len(out)
        seconds = time.perf_counter() - t0
    return {"tok_per_s": round(tokens / seconds, 2), "outputs": outputs}


def generate_together(address: str, prompts, new: int) -> float:
    """Every prompt at once (c = len(prompts)), plain, through a verifier: tok/s."""
    from concurrent.futures import ThreadPoolExecutor

    with grpc.insecure_channel(address) as channel:
        stub = verifier_pb2_grpc.VerifierStub(channel)

        def one(p) -> int:
            request = verifier_pb2.VerifyGenerateRequest(
                prompt_ids=p, max_new_tokens=new, ignore_eos=True
            )
            return sum(len(reply.token_ids) for reply in stub.Generate(request, timeout=300))

        t0 = time.perf_counter()
        with ThreadPoolExecutor(len(prompts)) as pool:
            tokens = sum(pool.map(one, prompts))
        return round(tokens / (time.perf_counter() - t0), 2)


def compare(recorded, vocab, prompts, new: int, k: int, acceptance: float, shapes, device, many=()):
    """Start two (drafter, verifier) pairs, one per drafting kind; each prompt through each
    verifier with speculation off and on. -> tok/s and whether outputs match plain; with
    `many` prompts, also their plain tok/s all at once through the first verifier."""
    target_shape, draft_shape = shapes
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"specd-services-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    data = {"vocab": vocab, "recorded": [[list(p), out] for p, out in recorded.items()]}
    (work / "recorded.json").write_text(json.dumps(data))
    base = [sys.executable, "-m", "bench.gpu.services", "--device", device]
    pairs = {"lookup": (50761, 50762, ""), "draft": (50763, 50764, draft_shape)}
    procs = []
    try:
        for d_port, v_port, inner in pairs.values():
            drafter = [*base, "drafter", "--port", str(d_port), "--recorded"]
            drafter += [str(work / "recorded.json"), "--acceptance", str(acceptance)]
            procs.append(subprocess.Popen([*drafter, "--draft-shape", inner]))
            verifier = [*base, "verifier", "--port", str(v_port), "--shape", target_shape]
            procs.append(subprocess.Popen([*verifier, "--drafter", f"{HOST}:{d_port}"]))
        for _, v_port, _ in pairs.values():
            _wait_serving(f"{HOST}:{v_port}", 240)
        out = {}
        if many:
            first = f"{HOST}:{pairs['lookup'][1]}"
            out["plain_together_tok_per_s"] = generate_together(first, many, new)
        for name, (_, v_port, _) in pairs.items():
            address = f"{HOST}:{v_port}"
            generate(address, prompts[:1], 8, k)  # warm
            off, on = generate(address, prompts, new, 0), generate(address, prompts, new, k)
            out[name] = {
                "off_tok_per_s": off["tok_per_s"],
                "on_tok_per_s": on["tok_per_s"],
                "on_vs_off": round(on["tok_per_s"] / off["tok_per_s"], 3),
                "identical": on["outputs"] == off["outputs"],
            }
        return out
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(20)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu.services")
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (%(default)s)")
    sub = p.add_subparsers(dest="role", required=True)
    d = sub.add_parser("drafter")
    d.add_argument("--port", type=int, required=True, help="where it listens")
    d.add_argument("--recorded", required=True, help="the target's greedy tokens (JSON)")
    d.add_argument(
        "--acceptance",
        type=float,
        default=0.8,
        help="the chance a draft is the recorded token (%(default)s)",
    )
    d.add_argument("--draft-shape", default="", help="run this draft model's forwards too")
    v = sub.add_parser("verifier")
    v.add_argument("--port", type=int, required=True, help="where it listens")
    v.add_argument("--drafter", required=True, help="the drafter's HOST:PORT")
    v.add_argument("--shape", default="llama-3.2-3b", help="the target's (%(default)s)")
    args = p.parse_args(argv)
    {"drafter": _drafter, "verifier": _verifier}[args.role](args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
