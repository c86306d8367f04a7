"""`specd bench gpu`: the CUDA step against the GPU's bandwidth limit and against
transformers with a static cache and `torch.compile`, on random weights with real
models' shapes (bench.gpu.shapes), one run.

    specd bench gpu [--target llama-3.2-3b] [--draft llama-3.2-1b] [--json F]
    specd bench gpu --device cpu --target tiny --draft tiny --also "" --emulate-ms 2 0.7

(the last on a CPU: the tiny shape at a GPU step's pace, `--emulate-ms`)

1. The device's copy bandwidth, and the bytes a decode step reads: the limit in tok/s.
2. Plain greedy decode at c = 1: specd's forward loop, specd's engine, and transformers
   (`cache_implementation="static"`, forward compiled `reduce-overhead`, fullgraph).
3. A verification step of n = 1..8 rows as a ratio to one row (graphs replayed).
4. Plain throughput at c = 32 against c = 1 (the engine).
5. Speculation at a controlled acceptance per draft (bench.gpu.controlled), k = 4, c = 1,
   against plain in the same run: drafts that cost nothing (a lookup), drafts behind the
   draft model's real forwards, and `auto` with the draft model; greedy outputs compared;
   then the same through verifier and drafter processes, to the verifier and through a
   router in front of it (bench.gpu.services), and a round's parts (`round_breakdown`).
6. Whole decode steps by (sequences, k) with the draft model drafting (`steps`, as `specd
   bench steps` measures them on a CPU), for `specd bench controller-batch --steps
   gpu.json`: `auto` at this GPU's prices, offline.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch

from bench.engine import ours_decode
from bench.gpu import goals
from bench.gpu.controlled import ControlledProposer
from bench.gpu.services import compare
from bench.gpu.shapes import SHAPES, build, bytes_per_token, emulated
from specd.config import EngineConfig
from specd.models.paged_kv import PagedKV
from specd.models.seq_input import SeqInput
from verifier_service.engine import Engine, Priced
from verifier_service.request import Request, SpeculationBounds
from verifier_service.sequence import SpecStats


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device, gib: float = 1.0, repeats: int = 10) -> float:
    """Bytes a second a device-to-device copy moves (read + written)."""
    x = torch.empty(int(gib * 2**30), dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        y.copy_(x)
    sync(device)
    return 2 * x.numel() * repeats / (time.perf_counter() - t0)


def verification_ratios(model, context: int, sizes, repeats: int = 20) -> dict[int, float]:
    kv = PagedKV.for_model(model, -(-(context + max(sizes) + 1) // 16) + 1)
    model.prepare_steps(kv, max_seqs=1, max_rows=max(sizes))
    kv.allocator.allocate(0)
    vocab = model.args.vocab_size
    model.forward(kv, [SeqInput(0, [10 + i % (vocab - 20) for i in range(context)])])
    times = {}
    for n in sizes:
        samples = []
        for i in range(repeats + 2):
            t0 = time.perf_counter()
            model.forward(kv, [SeqInput(0, list(range(10, 10 + n)), num_logits=n)])
            model.synchronize()
            if i >= 2:
                samples.append(time.perf_counter() - t0)
            kv.allocator.truncate_to(0, context)
        times[n] = statistics.median(samples)
    return {n: round(t / times[1], 3) for n, t in times.items()} | {"one_row_ms": times[1] * 1e3}


MEASURED_PASSES = 3  # a speculation run's passes after its first, the fastest reported


def engine_run(
    model, prompts, new: int, proposer=None, k: int = 0, auto=False, batch=1, warm=False,
    repeats: int = 1,
) -> dict:  # fmt: skip
    """All prompts through one engine, `batch` at a time: tok/s over the whole run. With
    `warm`, the prompts run again on the same engine and the figures are the later
    pass's, as a verifier that has run a while serves them (its speculation control has
    priced its steps; what was built at first use is built); `first_pass_tok_per_s` is the
    first's. `repeats` later passes: the fastest's figures (a shared machine's pauses
    land on a pass, not on what it measures)."""
    blocks = batch * -(-(len(prompts[0]) + new + 2 * k + 2) // 16)
    config = EngineConfig(max_batch_size=batch, num_blocks=blocks)
    engine = Engine(model, config, proposer, eos_ids=set())
    first = _pass(engine, prompts, new, k, auto, batch) if warm else None
    passes = [_pass(engine, prompts, new, k, auto, batch) for _ in range(max(1, repeats))]
    run = max(passes, key=lambda p: p["tok_per_s"])
    if first is not None:
        run["first_pass_tok_per_s"] = first["tok_per_s"]
    return run


def _pass(engine, prompts, new: int, k: int, auto: bool, batch: int) -> dict:
    before, control_s = dataclasses.replace(engine.totals), engine.control_s
    priced = {k: dataclasses.replace(p) for k, p in engine.priced.items()}
    outputs: dict[int, list[int]] = {}
    tokens = 0
    t0 = time.perf_counter()
    for start in range(0, len(prompts), batch):
        ids = [
            engine.add_request(
                Request(p, max_new_tokens=new, num_draft=k, speculation=SpeculationBounds(auto))
            )
            for p in prompts[start : start + batch]
        ]
        outputs.update({i: [] for i in ids})
        while engine.has_work():
            for o in engine.step():
                outputs[o.seq_id].extend(o.tokens)
                tokens += len(o.tokens)
    seconds = time.perf_counter() - t0
    t = engine.totals  # this pass's rounds alone
    this = SpecStats(
        t.rounds - before.rounds, t.drafted - before.drafted, t.accepted - before.accepted
    )
    return {
        "tok_per_s": round(tokens / seconds, 2),
        "acceptance": round(this.acceptance_rate, 3) if this.drafted else None,
        "tokens_per_round": round(this.mean_accepted_length, 3) if this.rounds else None,
        # the pass's time in the speculation control's plan and observe (Python between steps)
        "control_share": round((engine.control_s - control_s) / seconds, 4),
        "priced": _priced(engine.priced, priced),
        "outputs": list(outputs.values()),
    }


def _priced(now: dict[int, Priced], before: dict[int, Priced]) -> dict[str, dict]:
    """The pass's steps the speculation control priced, by the most drafts planned: how
    many, and their tokens and seconds over what it expected of them (Engine.priced)."""
    out = {}
    for k, p in sorted(now.items()):
        b = before.get(k, Priced())
        if p.steps > b.steps:
            out[str(k)] = {
                "steps": p.steps - b.steps,
                "tokens_vs_expected": round(
                    (p.tokens - b.tokens) / (p.expected_tokens - b.expected_tokens), 3
                ),
                "seconds_vs_expected": round(
                    (p.seconds - b.seconds) / (p.expected_seconds - b.expected_seconds), 3
                ),
            }
    return out


def round_breakdown(runs: dict, services: dict | None = None) -> dict:
    """A speculation round's parts in ms, each a round's time (tokens a round / tok/s)
    less another's: verification (the lookup run's round: its drafts cost nothing), the
    draft model's forwards (the draft run's round beyond that) and, with `services`, what
    the processes add: the verifier's (the lookup round through the verifier process
    beyond in-process: its Generate stream and the drafter's gRPC hop), the drafter's hop
    alone (beyond the verifier drafting the same lookup itself, where that set ran) and the
    router's (through the router beyond the verifier). Then what a second GPU drafting ahead
    would give: the draft forwards hidden behind verification, a round of
    max(verification, draft forwards) plus the processes' parts, against plain through
    the router (predicted, not measured)."""

    def round_ms(run: dict, tok_per_s: float | None = None) -> float:
        return 1e3 * run["tokens_per_round"] / (tok_per_s or run["tok_per_s"])

    lookup, draft = runs["lookup"], runs["draft"]
    verify = round_ms(lookup)
    forwards = round_ms(draft) - verify
    plain = 1e3 / runs["off"]["tok_per_s"]
    out = {"plain_step_ms": plain, "verify_ms": verify, "draft_forwards_ms": forwards}
    if services is not None:
        s = services["lookup"]
        verifier = round_ms(lookup, s["on_tok_per_s"]) - verify
        router = round_ms(lookup, s["router_on_tok_per_s"]) - verify - verifier
        ahead = 1e3 * draft["tokens_per_round"] / (max(verify, forwards) + verifier + router)
        out |= {"verifier_process_ms": verifier, "router_ms": router}
        if (own := services.get("lookup_in_verifier")) is not None:
            # the same lookup round asked of a drafter process, beyond drafting it in the verifier
            hop = round_ms(lookup, s["on_tok_per_s"]) - round_ms(lookup, own["on_tok_per_s"])
            out["drafter_hop_ms"] = hop
        out["second_gpu_ahead_tok_per_s"] = ahead
        out["second_gpu_ahead_vs_off"] = ahead / s["router_off_tok_per_s"]
    return {name: round(value, 3) for name, value in out.items()}


def transformers_compiled(hf, prompt: list[int], new: int) -> float:
    """transformers `generate`, static cache, forward compiled (gpt-fast's recipe): decode
    tok/s, a 1-token run's time (the prefill) taken off."""
    hf.generation_config.cache_implementation = "static"
    hf.forward = torch.compile(hf.forward, mode="reduce-overhead", fullgraph=True)
    ids = torch.tensor([prompt], device=hf.device)
    kw = dict(do_sample=False, min_new_tokens=new, max_new_tokens=new)
    for _ in range(2):  # compiles and captures
        hf.generate(ids, **kw)
    times = []
    for n in (1, new):
        sync(hf.device)
        t0 = time.perf_counter()
        hf.generate(ids, **dict(kw, min_new_tokens=n, max_new_tokens=n))
        sync(hf.device)
        times.append(time.perf_counter() - t0)
    return (new - 1) / (times[1] - times[0])


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab - 10, (length,), generator=g).tolist() for _ in range(n)]


def speculation(
    model, draft, prompts, new: int, k: int, acceptance: float, services=None, many=(),
    emulate_ms=(), keep=lambda partial: None,
):  # fmt: skip
    """Plain, then controlled drafts (free and behind the draft model), then `auto`, each
    engine's fastest of MEASURED_PASSES over the prompts after a first (`engine_run`'s
    `warm`), handed to `keep` (a run cut short in the services keeps them); and with
    `services` (target and draft shape) the same through verifier and drafter processes
    (bench.gpu.services), and `many` prompts at once through the verifier."""
    from drafter_service.draft_model import DraftModelProposer

    plain = engine_run(model, prompts, new, warm=True, repeats=MEASURED_PASSES)
    recorded = {tuple(p): out for p, out in zip(prompts, plain["outputs"], strict=True)}
    vocab = model.args.vocab_size

    def run(inner, auto=False):
        proposer = ControlledProposer(recorded, vocab, acceptance, inner)
        return engine_run(
            model, prompts, new, proposer, k, auto, warm=True, repeats=MEASURED_PASSES
        )

    runs = {
        "off": plain,
        "lookup": run(None),
        "draft": run(DraftModelProposer(draft, num_blocks=4096)),
        "draft-auto": run(DraftModelProposer(draft, num_blocks=4096), auto=True),
    }
    out = {}
    for name, run in runs.items():
        out[name] = {
            "tok_per_s": run["tok_per_s"],
            "vs_off": round(run["tok_per_s"] / plain["tok_per_s"], 3),
            "acceptance": run["acceptance"],
            "tokens_per_round": run["tokens_per_round"],
            "control_share": run["control_share"],
            "priced": run["priced"],
            "identical_to_off": run["outputs"] == plain["outputs"],
        }
    auto, better = out["draft-auto"], max(runs["draft"]["tok_per_s"], plain["tok_per_s"])
    auto["vs_better_of_on_off"] = round(auto["tok_per_s"] / better, 3)
    auto["first_pass_vs_off"] = round(
        runs["draft-auto"]["first_pass_tok_per_s"] / plain["tok_per_s"], 3
    )
    out["round_ms"] = round_breakdown(runs)
    keep(out)
    if services is None:
        return out
    setting = (recorded, vocab, prompts, new, k, acceptance, services, str(model.device), many)
    try:
        out["services"] = compare(*setting, emulate_ms, passes=MEASURED_PASSES)
    except Exception as e:  # reported, and the run goes on to its other parts (main fails)
        out["services_error"] = f"{type(e).__name__}: {e}"[:500]
        print(f"services failed: {out['services_error']}")
        return out
    in_process = {"lookup_in_verifier": "lookup"}  # the same drafts, no drafter's hop
    for name in ("lookup", "draft", "lookup_in_verifier"):  # what processes and gRPC cost
        s, measured = out["services"][name], runs[in_process.get(name, name)]
        s["on_vs_in_process"] = round(s["on_tok_per_s"] / measured["tok_per_s"], 3)
        s["off_vs_in_process"] = round(s["off_tok_per_s"] / plain["tok_per_s"], 3)
    out["round_ms"] = round_breakdown(runs, out["services"])
    return out


def controller_steps(target, draft, prompt_tokens: int) -> dict:
    """Whole decode steps of the engine by (sequences, k), the draft model drafting every
    round's k in-process (`bench.step_costs.measure`)."""
    from bench.step_costs import measure
    from drafter_service.draft_model import DraftModelProposer

    sizes, ks, tokens = (1, 2, 4, 8, 16), (0, 1, 2, 4, 6), (32, 24)
    blocks = max(sizes) * -(-(prompt_tokens + tokens[0] + 2 * max(ks) + 2) // 16)
    config = EngineConfig(max_batch_size=max(sizes), num_blocks=blocks)
    proposer = DraftModelProposer(draft, num_blocks=4096, prefix_cache=True)
    engine = Engine(target, config, proposer, eos_ids=set())
    prompts = _prompts(max(sizes), prompt_tokens, target.args.vocab_size, 4)
    return measure(engine, prompts, sizes, ks, tokens)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specd bench gpu", description=__doc__.split("\n")[0])
    shapes = "random weights of this model's shapes (default: %(default)s)"
    p.add_argument("--target", default="llama-3.2-3b", choices=sorted(SHAPES), help=shapes)
    p.add_argument("--draft", default="llama-3.2-1b", choices=sorted(SHAPES), help=shapes)
    p.add_argument(
        "--also", default="qwen2.5-1.5b", help="more targets: plain decode, no peer (%(default)s)"
    )
    p.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu for a smoke run")
    p.add_argument("--prompt-tokens", type=int, default=128, help="a prompt (%(default)s)")
    p.add_argument("--new-tokens", type=int, default=256, help="tokens decoded (%(default)s)")
    p.add_argument(
        "--acceptance",
        type=float,
        default=0.8,
        help="the chance a draft is the target's own greedy token (%(default)s)",
    )
    p.add_argument("-k", type=int, default=4, help="drafts a round (%(default)s)")
    p.add_argument("--no-peer", action="store_true", help="skip transformers")
    p.add_argument("--no-services", action="store_true", help="skip the gRPC services")
    p.add_argument("--json", help="write the report here")
    p.add_argument(
        "--emulate-ms",
        type=float,
        nargs=2,
        default=(0.0, 0.0),
        metavar=("TARGET", "DRAFT"),
        help="on a CPU: sleep this many ms before each target and each draft model "
        "forward (in-process and in the services), a GPU step's pace for the tiny shape",
    )
    return p


def _decode(report: dict, shape: str, args):
    """Plain decode of `shape` at c = 1 against its limit; -> (transformers model, ours)."""
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    hf, ours = build(shape, args.device, dtype)
    emulated(ours, args.emulate_ms[0] / 1e3, queued=True)
    prompt = _prompts(1, args.prompt_tokens, ours.args.vocab_size, 0)[0]
    loop, _ = ours_decode(ours, prompt, args.new_tokens)  # model.forward alone
    engine = engine_run(ours, [prompt], args.new_tokens)["tok_per_s"]
    size = bytes_per_token(ours)
    limit = report["copy_bandwidth_gbs"] * 1e9 / size
    report["decode"][shape] = {
        "weight_bytes_per_token": size,
        "limit_tok_per_s": round(limit, 1),
        "forward_loop_tok_per_s": round(loop, 1),
        "engine_tok_per_s": engine,
        "engine_of_limit": round(engine / limit, 3),
    }
    print(f"{shape}: limit {limit:.0f} tok/s; forward loop {loop:.1f}, engine {engine:.1f}")
    return hf, ours, prompt


def _peer(report: dict, shape: str, hf, prompt, new: int) -> None:
    r = report["decode"][shape]
    try:
        r["transformers_compiled_tok_per_s"] = round(transformers_compiled(hf, prompt, new), 1)
        r["engine_vs_transformers"] = round(
            r["engine_tok_per_s"] / r["transformers_compiled_tok_per_s"], 3
        )
        print(f"{shape}: transformers static + compile {r['transformers_compiled_tok_per_s']}")
    except Exception as e:  # the peer's failure is reported, ours is not hidden
        r["transformers_error"] = f"{type(e).__name__}: {e}"[:500]
        print(f"{shape}: transformers failed: {r['transformers_error']}")


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if any(args.emulate_ms) and args.device != "cpu":
        parser.error("--emulate-ms is for a CPU: a GPU runs at its own pace")
    report: dict = {"device": args.device, "torch": torch.__version__, "decode": {}}
    report["target"] = args.target
    if any(args.emulate_ms):
        report["emulated_forward_ms"] = dict(zip(("target", "draft"), args.emulate_ms, strict=True))

    started = time.perf_counter()
    report["elapsed_s"] = {}  # each part's end, in seconds from the start (the check's budget)

    def save(part: str):  # after every part: a run cut short keeps what it measured
        report["elapsed_s"][part] = round(time.perf_counter() - started, 1)
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1))

    if args.device == "cuda":
        report["gpu"] = torch.cuda.get_device_name()
    report["copy_bandwidth_gbs"] = round(copy_bandwidth(args.device) / 1e9, 1)
    print(f"copy bandwidth {report['copy_bandwidth_gbs']} GB/s")
    hf, target, prompt = _decode(report, args.target, args)
    save("decode")
    context = min(512, target.args.max_position_embeddings // 2)
    report["verification_ratio"] = verification_ratios(target, context, (1, 2, 3, 4, 5, 6, 8))
    print(f"verification / one row: {report['verification_ratio']}")
    vocab = target.args.vocab_size
    one = _prompts(1, args.prompt_tokens, vocab, 1)
    many = _prompts(32, args.prompt_tokens, vocab, 2)
    c1 = engine_run(target, one, args.new_tokens // 2)["tok_per_s"]
    c32 = engine_run(target, many, args.new_tokens // 2, batch=32)["tok_per_s"]
    report["c32"] = {"c1_tok_per_s": c1, "c32_tok_per_s": c32, "ratio": round(c32 / c1, 2)}
    print(f"c = 32 plain: {c32} tok/s, {c32 / c1:.1f}x c = 1")
    save("verification and c32")
    _, draft = build(args.draft, args.device, target.dtype, seed=1, draft=True)
    emulated(draft, args.emulate_ms[1] / 1e3)
    prompts = _prompts(4, args.prompt_tokens, vocab, 3)
    new = args.new_tokens // 2
    services = None if args.no_services else (args.target, args.draft)
    setting = dict(k=args.k, acceptance=args.acceptance, c=1)

    def keep(partial: dict) -> None:
        report["speculation"] = partial | {"setting": setting}
        save("speculation in-process")

    report["speculation"] = speculation(
        target, draft, prompts, new, args.k, args.acceptance, services, many, args.emulate_ms,
        keep,
    ) | {"setting": setting}  # fmt: skip
    failed = "services_error" in report["speculation"]
    if services is not None and not failed:  # c = 32 plain through the verifier, against in-process
        together = report["speculation"]["services"].pop("plain_together_tok_per_s")
        report["c32"]["services_tok_per_s"] = together
        report["c32"]["services_vs_in_process"] = round(together / c32, 3)
        print(
            f"c = 32 plain through the verifier: {together} tok/s, {together / c32:.2f}x in-process"
        )
    for name, r in report["speculation"].items():
        print(f"speculation {name}: {r}")
    save("speculation")
    try:
        report.update(controller_steps(target, draft, args.prompt_tokens))
    except Exception as e:  # an offline tool's table: its failure must not cost the rest
        report["steps_error"] = f"{type(e).__name__}: {e}"[:500]
        print(f"steps failed: {report['steps_error']}")
    del draft
    save("steps")
    if not args.no_peer and not any(args.emulate_ms):  # transformers runs at its own pace
        _peer(report, args.target, hf, prompt, args.new_tokens)
        save("transformers")
    del hf, target
    for shape in filter(None, args.also.split(",")):
        _decode(report, shape, args)  # plain decode only: the peer's compile takes minutes
        save(f"decode {shape}")
    report["goals"] = goals.judge(report)
    save("goals")
    print(goals.table(report))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
