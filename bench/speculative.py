"""`specd bench spec`: speculation vs none on a workload, against transformers, one run.

    specd bench spec --workload code [--configs off,draft:2,draft:3,...] [--peer hf]

Concurrency 1, greedy. Each config runs every prompt through the in-process engine;
tokens/s = generated tokens / wall time (prefill included), summed over prompts. Ratios
are against `off` measured in the same run. `--peer hf` adds transformers `generate`
(plain, assisted generation with the draft model, prompt lookup) on the same weights.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from bench import flags
from bench.hf_generate import first_divergence, run_hf
from bench.prompts import load_workload
from drafter_service.combined import CombinedProposer
from drafter_service.draft_model import DraftModelProposer, load_draft_model
from specd.config import EngineConfig
from specd.lookup import NgramProposer
from specd.models.loader import eos_token_ids, load_config, load_model, load_tokenizer, resolve
from verifier_service.engine import Engine
from verifier_service.request import Request, SpeculationBounds

DEFAULT_CONFIGS = "off,draft:2,draft:3,draft:4,draft:6,ngram:3,ngram:5"
# draft[-int8|-int4][-vN][-auto]:k  e.g. draft-int8-v32768:4 = int8 draft weights, a
# 32768-token head, k=4 (the draft's weights dense without -int8/-int4); -auto: the
# speculation controller picks up to k per step;
# -inv (also off-inv): batch-invariant mode;
# combo[-int8|-int4][-vN]:k = n-gram where the text repeats, else that draft model;
# -aN (draft, combo): the runner-up as an alternative leaf beside the first N drafts


def generate_one(engine: Engine, ids: list[int], k: int, max_new: int, auto=False) -> list[int]:
    """One request alone through the engine (concurrency 1): its generated tokens."""
    bounds = SpeculationBounds(auto=auto)
    seq_id = engine.add_request(
        Request(ids, max_new_tokens=max_new, num_draft=k, speculation=bounds)
    )
    out = []
    while engine.has_work():
        for o in engine.step():
            if o.seq_id == seq_id:
                out.extend(o.tokens)
    return out


def run_engine_config(engine: Engine, prompts, k: int, max_new: int, auto=False) -> dict:
    tokens, seconds, outputs = 0, 0.0, []
    before = (engine.totals.drafted, engine.totals.accepted, engine.totals.rounds)
    for ids in prompts:
        t0 = time.perf_counter()
        out = generate_one(engine, ids, k, max_new, auto)
        seconds += time.perf_counter() - t0
        tokens += len(out)
        outputs.append(out)
    drafted = engine.totals.drafted - before[0]
    accepted = engine.totals.accepted - before[1]
    rounds = engine.totals.rounds - before[2]
    return {
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tok_per_s": tokens / seconds,
        "acceptance": accepted / drafted if drafted else None,
        "mean_accepted_length": (accepted + rounds) / rounds if rounds else None,
        "outputs": outputs,
    }


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specd bench spec", description=__doc__.split("\n")[0])
    p.add_argument("--workload", default="code", help=flags.workload())
    p.add_argument("--target", default="default-target", help=f"the target: {flags.MODEL}")
    p.add_argument("--draft", default="default-draft", help=f"the draft model: {flags.MODEL}")
    p.add_argument("--dtype", default="auto", help=f"both models' {flags.DTYPE}")
    p.add_argument(
        "--configs",
        default=DEFAULT_CONFIGS,
        help="off, draft[-int8|-int4][-vN][-auto][-inv]:k or ngram:k, comma-separated (the "
        "module's docstring; default: %(default)s)",
    )
    p.add_argument("--max-new-tokens", type=int, default=128, help=flags.MAX_NEW_TOKENS)
    p.add_argument(
        "--limit", type=int, default=0, help="first N prompts only (0, the default: all)"
    )
    p.add_argument("--batch-invariant", action="store_true", help="every config batch-invariant")
    p.add_argument(
        "--peer",
        choices=["none", "hf"],
        default="none",
        help="hf: also transformers' generate on the same weights (default: %(default)s)",
    )
    p.add_argument("--json", help="write the full report here")
    return p


class DraftModels:
    """The draft model in each variant a config names, loaded once each."""

    def __init__(self, folder, dtype: str):
        self.folder, self.dtype, self.loaded = folder, dtype, {}

    def __call__(self, kind: str):
        """draft[-int8|-int4][-vN]: the draft model, int8 or int4 weights and/or an N-token
        head."""
        mods = kind.split("-")[1:]
        weights = next((m for m in mods if m in ("int8", "int4")), "bf16")
        vocab = next((int(m[1:]) for m in mods if m.startswith("v")), 0)
        if (weights, vocab) not in self.loaded:
            self.loaded[weights, vocab] = load_draft_model(
                self.folder, self.dtype, None, weights, vocab
            )
        return self.loaded[weights, vocab]


def _proposer(kind: str, drafts: DraftModels, top_m: int):
    """A config's proposer: draft[-mods] / combo[-mods] (-aN: N alternatives), ngram, off."""
    if kind.startswith(("draft", "combo")):
        mods = kind.split("-")[1:]
        alts = next((int(m[1:]) for m in mods if m[:1] == "a" and m[1:].isdigit()), 0)
        proposer = DraftModelProposer(drafts(kind), num_blocks=512, top_m=top_m, alternatives=alts)
        return CombinedProposer(proposer) if kind.startswith("combo") else proposer
    return NgramProposer() if kind == "ngram" else None


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    folder, draft_folder = resolve(args.target), resolve(args.draft)
    prompts = load_workload(args.workload, load_tokenizer(folder), args.limit or None)
    target = load_model(folder, dtype=args.dtype)
    eos = eos_token_ids(folder, load_config(folder))
    drafts = DraftModels(draft_folder, args.dtype)
    cfg = EngineConfig(batch_invariant=args.batch_invariant, max_draft_tokens=16)
    print(
        f"workload {args.workload}: {len(prompts)} prompts, {args.max_new_tokens} new tokens, "
        f"{target.dtype}, threads {torch.get_num_threads()}"
    )
    results = {}
    for name in [c.strip() for c in args.configs.split(",") if c.strip()]:
        kind, _, k = name.partition(":")
        mods = kind.split("-")[1:]
        engine_cfg = dataclasses.replace(
            cfg, batch_invariant=cfg.batch_invariant or "inv" in mods, cost_model="auto" in mods
        )
        engine = Engine(target, engine_cfg, _proposer(kind, drafts, cfg.draft_top_m), eos)
        results[name] = run_engine_config(
            engine, prompts, int(k or 0), args.max_new_tokens, auto="auto" in mods
        )
        _print_row(name, results[name], results.get("off"))
    if args.peer == "hf":
        peer = run_hf(folder, draft_folder, prompts, args.max_new_tokens, target.dtype)
        for name, r in peer.items():
            results[name] = r
            _print_row(name, r, results.get("off"))
    _divergences(results)
    if args.json:
        report = {"workload": args.workload, "dtype": str(target.dtype), "results": results}
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


def _divergences(results: dict) -> None:
    if "off" in results:
        base = results["off"]["outputs"]
        for r in results.values():
            r["first_divergence_vs_off"] = first_divergence(r["outputs"], base)


def _print_row(name: str, r: dict, base: dict | None) -> None:
    ratio = f"{r['tok_per_s'] / base['tok_per_s']:.2f}x" if base else "-"
    acc = f"{r['acceptance']:.0%}" if r.get("acceptance") is not None else "-"
    mal = f"{r['mean_accepted_length']:.2f}" if r.get("mean_accepted_length") else "-"
    print(
        f"  {name:<18} {r['tok_per_s']:6.2f} tok/s  {ratio:>6}  acceptance {acc:>4}  "
        f"mean accepted length {mal}",
        flush=True,
    )


if __name__ == "__main__":
    raise SystemExit(main())
