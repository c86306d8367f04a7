"""Speculation through the services on one GPU at a controlled acceptance: a verifier
process and a drafter process (gRPC between them, as deployed) on random weights of real
shapes, against plain decoding through the same verifier and against the same engine
in-process (bench.gpu.run measures that side in the same run).

Three sets run side by side, each with a router in front: a drafter that proposes
without a model (a lookup's cost), one behind the draft model's real forwards
(bench.gpu.controlled), and a verifier that proposes so itself, with no drafter (as
`specd serve verifier --lookup` drafts: no gRPC hop a round). The client speaks token
ids to each verifier directly (as the router sends them) and through its router (as
users do, router -> verifier -> drafter); random weights come with no tokenizer, so the
routers read one of made-up words (`write_tokenizer`) to check and decode the ids.

    python -m bench.gpu.services drafter --port P --recorded F [--draft-shape S]
    python -m bench.gpu.services verifier --port P --drafter HOST:PORT [--shape S]
    python -m bench.gpu.services verifier --port P --recorded F [--shape S]

(each with `--emulate-ms MS` on a CPU: its model's forwards at a GPU step's pace)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import torch

from bench.gpu.controlled import ControlledProposer
from bench.gpu.shapes import build, emulated
from protos.specd.v1 import router_pb2, verifier_pb2, verifier_pb2_grpc
from specd.openmp import settle_spinning, settle_threads

HOST = "127.0.0.1"
# the router's health service: serving once one of its verifiers is
ROUTER_SERVICE = router_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


def _drafter(args) -> None:
    from drafter_service.draft_model import DraftModelProposer
    from drafter_service.server import serve
    from specd.config import DrafterConfig

    inner = None
    if args.draft_shape:
        _, draft = build(args.draft_shape, args.device, dtype(args.device), seed=1, draft=True)
        inner = DraftModelProposer(emulated(draft, args.emulate_ms / 1e3), num_blocks=4096)
    proposer, vocab = _controlled(args, inner)
    config = DrafterConfig(host=HOST, port=args.port)
    asyncio.run(serve(config, built=(proposer, vocab, "controlled")))


def _controlled(args, inner=None) -> tuple[ControlledProposer, int]:
    """The proposer of the target's recorded tokens at `args.acceptance`, and the vocab."""
    data = json.loads(Path(args.recorded).read_text())
    recorded = {tuple(p): out for p, out in data["recorded"]}
    return ControlledProposer(recorded, data["vocab"], args.acceptance, inner), data["vocab"]


def _verifier(args) -> None:
    from specd.config import EngineConfig, VerifierConfig
    from verifier_service.drafter_client import RemoteProposer
    from verifier_service.engine import Engine
    from verifier_service.startup import serve

    _, target = build(args.shape, args.device, dtype(args.device))
    emulated(target, args.emulate_ms / 1e3, queued=True)
    config = VerifierConfig(host=HOST, port=args.port, drafter=args.drafter or "")
    if args.drafter:
        proposer = RemoteProposer(args.drafter, config.drafter_timeout_ms, 1000, None)
    else:  # its own lookup's cost, in its own process
        proposer, _ = _controlled(args)
    # 32 sequences of up to 512 tokens (the c = 32 run's), as the in-process engine holds
    engine_config = EngineConfig(max_batch_size=32, num_blocks=32 * 512 // 16)
    engine = Engine(target, engine_config, proposer, eos_ids=set())
    asyncio.run(serve(config, engine=engine, model_name=args.shape))


def model_service_env() -> dict[str, str]:
    """The environment `specd serve` gives a drafter and a verifier that has one
    (specd/openmp.py): OpenMP threads by the CPU limit, and short spinning, as the two take
    turns on the cores. Set here, before their torch loads."""
    env = dict(os.environ)
    settle_threads(env)
    settle_spinning(env)
    return env


def dtype(device: str) -> torch.dtype:
    return torch.bfloat16 if device.startswith("cuda") else torch.float32


def write_tokenizer(folder: Path, vocab: int) -> Path:
    """A router's tokenizer for random weights: `vocab` made-up words ("t0", "t1", ...),
    one per id, in `folder`/tokenizer.json; -> folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def _wait_serving(address: str, deadline_s: float, service: str = "") -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    end = time.monotonic() + deadline_s
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < end:
            with contextlib.suppress(grpc.RpcError):
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
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


def generate_routed(address: str, prompts, new: int, speculation: str) -> dict:
    """Each prompt alone (c = 1) through a router, speculation "on" (the route's k) or
    "off": tok/s and the outputs."""
    from router.client import SpecdClient

    outputs, tokens = [], 0
    with SpecdClient(address) as client:
        t0 = time.perf_counter()
        for p in prompts:
            stream = client.stream(
                token_ids=p, max_new_tokens=new, ignore_eos=True, speculation=speculation,
                timeout=300,
            )  # fmt: skip
            out = [t for reply in stream for t in reply.token_ids]
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


def compare(
    recorded, vocab, prompts, new: int, k: int, acceptance: float, shapes, device, many=(),
    emulate_ms=(), passes: int = 1,
):  # fmt: skip
    """Start three sets of a verifier and its router, one per drafting kind (a drafter
    of each kind, and none for the lookup in the verifier); each prompt through each
    verifier and through each router with speculation off and on. -> tok/s
    and whether outputs match plain; with `many` prompts, also their plain tok/s all at
    once through the first verifier. `emulate_ms`: (target, draft) ms each model's forward
    sleeps first (`emulated`); `passes`: `_through`'s."""
    target_shape, draft_shape = shapes
    base = [sys.executable, "-m", "bench.gpu.services", "--device", device]
    target_ms, draft_ms = emulate_ms or (0.0, 0.0)
    env = model_service_env()
    pairs = {
        "lookup": (50761, 50762, 50765, ""),
        "draft": (50763, 50764, 50766, draft_shape),
        "lookup_in_verifier": (0, 50767, 50768, ""),  # no drafter
    }
    work = Path(tempfile.mkdtemp(prefix="specd-services-"))  # the services' inputs
    procs, sets = [], {}
    try:
        data = {"vocab": vocab, "recorded": [[list(p), out] for p, out in recorded.items()]}
        (work / "recorded.json").write_text(json.dumps(data))
        policy = work / "policy.yaml"
        # `auto` by default: a request's "on" and "off" override it (router/decide.py)
        policy.write_text(f'default: {{speculation: "auto", num_draft_tokens: {k}}}\n')
        tokenizer = write_tokenizer(work / "tokenizer", vocab)
        router = [sys.executable, "-m", "launcher", "serve", "router"]
        router += ["--tokenizer", str(tokenizer), "--policy-file", str(policy)]
        controlled = ["--recorded", str(work / "recorded.json"), "--acceptance", str(acceptance)]
        for name, (d_port, v_port, r_port, inner) in pairs.items():
            started = len(procs)
            verifier = [*base, "verifier", "--port", str(v_port), "--shape", target_shape]
            verifier += ["--emulate-ms", str(target_ms)]
            if d_port:
                drafter = [*base, "drafter", "--port", str(d_port), *controlled]
                drafter += ["--emulate-ms", str(draft_ms), "--draft-shape", inner]
                procs.append(subprocess.Popen(drafter, env=env))
                verifier += ["--drafter", f"{HOST}:{d_port}"]
            else:
                verifier += controlled
            procs.append(subprocess.Popen(verifier, env=env))
            at = ["--port", str(r_port), "--verifier", f"{HOST}:{v_port}"]
            procs.append(subprocess.Popen([*router, *at]))
            sets[name] = procs[started:]
        for _, v_port, r_port, _ in pairs.values():
            _wait_serving(f"{HOST}:{v_port}", 240)
            _wait_serving(f"{HOST}:{r_port}", 60, ROUTER_SERVICE)
        out = {}
        if many:
            first = f"{HOST}:{pairs['lookup'][1]}"
            with _alone(sets, "lookup"):
                out["plain_together_tok_per_s"] = generate_together(first, many, new)
        for name, (_, v_port, r_port, _) in pairs.items():
            with _alone(sets, name):
                addresses = f"{HOST}:{v_port}", f"{HOST}:{r_port}"
                out[name] = _through(*addresses, prompts, new, k, passes)
        return out
    finally:
        _continue(procs)
        for p in procs:
            p.terminate()
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(20)
        shutil.rmtree(work, ignore_errors=True)


def _through(address: str, routed: str, prompts, new: int, k: int, passes: int = 1) -> dict:
    """Each prompt through a verifier and through its router, speculation off and on, and
    `auto` through the router (the verifier's control deciding every step, on the prices
    and acceptance it learned in the passes before). `auto`'s first pass is reported
    apart (`router_auto_first_pass_tok_per_s`): a fresh control spends its exploring
    budget's start there (SpeculationConfig.explore_cap_steps), once in a verifier's life.
    Then `passes` rounds of the five, in turn (a shared machine's pauses spread over all),
    each one's fastest pass reported, as `engine_run`'s; every pass's outputs checked."""
    generate(address, prompts[:1], 8, k)  # warm
    _warm_routed(routed, prompts[:1])
    first_auto = generate_routed(routed, prompts, new, "auto")
    runs: dict[str, list[dict]] = {
        "off": [], "on": [], "router_off": [], "router_on": [], "router_auto": [],
    }  # fmt: skip
    for _ in range(max(1, passes)):
        runs["off"].append(generate(address, prompts, new, 0))
        runs["on"].append(generate(address, prompts, new, k))
        for mode in ("off", "on", "auto"):
            runs[f"router_{mode}"].append(generate_routed(routed, prompts, new, mode))
    plain = runs["off"][0]["outputs"]
    same = {name: all(r["outputs"] == plain for r in rs) for name, rs in runs.items()}
    speed = {name: max(r["tok_per_s"] for r in rs) for name, rs in runs.items()}
    better = max(speed["router_on"], speed["router_off"])
    return {
        "off_tok_per_s": speed["off"],
        "on_tok_per_s": speed["on"],
        "on_vs_off": round(speed["on"] / speed["off"], 3),
        "identical": same["off"] and same["on"],
        "router_off_tok_per_s": speed["router_off"],
        "router_on_tok_per_s": speed["router_on"],
        "router_on_vs_off": round(speed["router_on"] / speed["router_off"], 3),
        "router_identical": same["router_off"] and same["router_on"],
        "router_auto_tok_per_s": speed["router_auto"],
        "router_auto_vs_better_of_on_off": round(speed["router_auto"] / better, 3),
        "router_auto_identical": same["router_auto"] and first_auto["outputs"] == plain,
        "router_auto_first_pass_tok_per_s": first_auto["tok_per_s"],
        "passes": max(1, passes),
    }


def _warm_routed(routed: str, prompts, deadline_s: float = 30.0) -> None:
    """One short request through a router, retried while it says no verifier is healthy:
    a router paused with its set (`_alone`) holds a load report older than it trusts
    until the next one arrives."""
    end = time.monotonic() + deadline_s
    while True:
        try:
            generate_routed(routed, prompts, 8, "on")
            return
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > end:
                raise
            time.sleep(0.2)


def _pause(procs) -> None:
    """Stop the other set's processes while one set is measured: idle, each still wakes
    (load reports, gRPC's timers) on the cores the measured set runs on."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGSTOP)


def _continue(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)


@contextlib.contextmanager
def _alone(sets: dict, name: str):
    others = [p for other, ps in sets.items() if other != name for p in ps]
    _pause(others)
    try:
        yield
    finally:
        _continue(others)


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
    d.add_argument("--emulate-ms", type=float, default=0.0, help="sleep before each forward")
    v = sub.add_parser("verifier")
    v.add_argument("--port", type=int, required=True, help="where it listens")
    drafts = v.add_mutually_exclusive_group(required=True)
    drafts.add_argument("--drafter", help="the drafter's HOST:PORT")
    drafts.add_argument("--recorded", help="or draft these recorded tokens itself (JSON)")
    v.add_argument("--acceptance", type=float, default=0.8, help="with --recorded (%(default)s)")
    v.add_argument("--shape", default="llama-3.2-3b", help="the target's (%(default)s)")
    v.add_argument("--emulate-ms", type=float, default=0.0, help="sleep before each forward")
    args = p.parse_args(argv)
    {"drafter": _drafter, "verifier": _verifier}[args.role](args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
