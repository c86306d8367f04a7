"""`specd bench quality`: what each weight format costs in model quality.

    specd bench quality [--model default-target] [--formats bf16,int8,int4] [--tokens 128]
    specd bench quality --dtype auto --formats int4/fp32,int4/fp16   # K/V cache dtypes

For each format (`weights` or `weights/kv-dtype`), against the first one (by default
`bf16`, for a GGUF model its blocks dequantised, what specd served before int8/int4
existed):
1. mean negative log-likelihood per token on a small fixed text set (the first 512 tokens
   of a few of this repository's own files: code and prose), and its ratio to bf16's;
2. greedy agreement over the first `--tokens` tokens on code and chat prompts: the share of
   positions equal to bf16's output and the mean length of the common prefix.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench import flags
from bench.prompts import load_workload
from specd.models.loader import load_model, load_tokenizer, resolve
from specd.models.paged_kv import PagedKV
from specd.models.seq_input import SeqInput

TEXTS = ["specd/sampling.py", "specd/kvcache.py", "router/detok.py", "README.md"]
ROOT = Path(__file__).resolve().parents[1]


def nll(model, ids: list[int]) -> tuple[float, int]:
    """Summed NLL of ids[1:] given the prefix, and the count."""
    kv = PagedKV.for_model(model, num_blocks=-(-len(ids) // 16) + 1)
    kv.allocator.allocate(0)
    logits = model.forward(kv, [SeqInput(0, ids, num_logits=len(ids))])[:-1]
    target = torch.tensor(ids[1:])
    lp = torch.log_softmax(logits.float(), dim=-1).gather(1, target[:, None])
    return float(-lp.sum()), len(target)


def greedy(model, prompt: list[int], n: int, stops=frozenset()) -> list[int]:
    """n greedy tokens, or fewer up to a stop token (kept)."""
    kv = PagedKV.for_model(model, num_blocks=-(-(len(prompt) + n) // 16) + 1)
    kv.allocator.allocate(0)
    logits = model.forward(kv, [SeqInput(0, prompt)])
    out = []
    while len(out) < n and (not out or out[-1] not in stops):
        out.append(int(logits[-1].argmax()))
        logits = model.forward(kv, [SeqInput(0, [out[-1]])])
    return out


def agreement(a: list[int], b: list[int]) -> tuple[float, int]:
    same = sum(x == y for x, y in zip(a, b, strict=True)) / len(a)
    prefix = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
    return same, prefix


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specd bench quality", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="default-target", help=flags.MODEL)
    p.add_argument(
        "--formats",
        default="bf16,int8,int4",
        help="weights[/kv dtype], comma-separated (%(default)s)",
    )
    p.add_argument("--dtype", default="bf16", help="activations (auto: the device's; %(default)s)")
    p.add_argument(
        "--tokens", type=int, default=128, help="greedy tokens compared a prompt (%(default)s)"
    )
    p.add_argument("--prompts", type=int, default=4, help="per workload (code, chat; %(default)s)")
    args = p.parse_args(argv)
    folder = resolve(args.model)
    tok = load_tokenizer(folder)
    texts = [tok((ROOT / f).read_text())["input_ids"][:512] for f in TEXTS]
    prompts = load_workload("code", tok, args.prompts) + load_workload("chat", tok, args.prompts)
    report, base = {}, None
    for fmt in args.formats.split(","):
        weights, _, kv = fmt.partition("/")
        model = load_model(folder, args.dtype, "cpu", weights, kv or "auto")
        total, count = map(sum, zip(*(nll(model, t) for t in texts), strict=True))
        outs = [greedy(model, pr, args.tokens) for pr in prompts]
        kv_dtype = str(model.kv_dtype).removeprefix("torch.")
        row = {"weights": model.weights, "kv": kv_dtype, "nll": total / count}
        if base is None:
            base = row["nll"], outs
        else:
            row["nll_vs_first"] = row["nll"] / base[0]
            pairs = [agreement(o, b) for o, b in zip(outs, base[1], strict=True)]
            row["agreement"] = sum(s for s, _ in pairs) / len(pairs)
            row["common_prefix"] = sum(n for _, n in pairs) / len(pairs)
        report[fmt] = row
        print(fmt, json.dumps(row), flush=True)
        del model
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
