"""`specd bench engine`: decode speed vs transformers, and the verification cost curve.

    specd bench engine [--model default-target] [--dtype bf16] [--context 512]
    specd bench engine --weights auto --no-hf      # the weights the verifier serves

1. Batch-1 greedy decode tokens/s of our forward vs `transformers` `generate` on the same
   dense weights and dtype, in the same run (`--weights`: ours at int8, int4 or the
   verifier's choice instead, against the dense peer).
2. Time of one forward appending n = 1, 2, 4, 6, 8, 16 tokens to a `--context`-token
   context, as a ratio to n = 1 (what a speculative verification costs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bench import flags
from specd.models.loader import load_model, resolve
from specd.models.paged_kv import PagedKV
from specd.models.seq_input import SeqInput


def _median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def ours_decode(model, prompt: list[int], new_tokens: int) -> tuple[float, list[int]]:
    kv = PagedKV.for_model(model, num_blocks=-(-(len(prompt) + new_tokens + 1) // 16))
    model.prepare_steps(kv, max_seqs=1, max_rows=8)  # CUDA graphs (nothing on a CPU)
    kv.allocator.allocate(0)
    logits = model.forward(kv, [SeqInput(0, prompt)])
    out = []
    t0 = time.perf_counter()
    for _ in range(new_tokens):
        out.append(int(logits[-1].argmax()))
        logits = model.forward(kv, [SeqInput(0, [out[-1]])])
        model.synchronize()  # a GPU's forward returns queued (LlamaModel.queued)
    return new_tokens / (time.perf_counter() - t0), out


def hf_decode(folder, dtype, prompt: list[int], new_tokens: int) -> tuple[float, list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    ids = torch.tensor([prompt])
    kw = dict(do_sample=False, min_new_tokens=new_tokens, max_new_tokens=new_tokens)
    hf.generate(ids, max_new_tokens=2, do_sample=False)  # warm-up
    # generate's time includes the prefill: subtract a 1-token run to keep decode only
    t0 = time.perf_counter()
    hf.generate(ids, max_new_tokens=1, do_sample=False)
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = hf.generate(ids, **kw)[0, len(prompt) :].tolist()
    return (new_tokens - 1) / (time.perf_counter() - t0 - prefill), out


def verification_curve(model, context: int, sizes, repeats: int) -> dict[int, float]:
    kv = PagedKV.for_model(model, num_blocks=-(-(context + max(sizes) + 1) // 16))
    kv.allocator.allocate(0)
    g = torch.Generator().manual_seed(0)
    vocab = model.args.vocab_size
    model.forward(kv, [SeqInput(0, torch.randint(0, vocab, (context,), generator=g).tolist())])
    result = {}
    for n in sizes:
        tokens = torch.randint(0, vocab, (n,), generator=g).tolist()

        def step(tokens=tokens, n=n):
            model.forward(kv, [SeqInput(0, tokens, num_logits=n)])
            model.synchronize()
            kv.allocator.truncate_to(0, context)

        result[n] = _median_time(step, repeats)
    return result


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specd bench engine", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="default-target", help=flags.MODEL)
    p.add_argument("--dtype", default="auto", help=flags.DTYPE)
    p.add_argument(
        "--weights",
        default="bf16",
        help="ours: bf16 (the dense weights transformers runs), int8, int4, or auto (what "
        "`specd serve verifier` loads: int4 on a CPU with AVX2 or AVX512-VNNI; default "
        "%(default)s)",
    )
    p.add_argument(
        "--context", type=int, default=512, help="the context a verification extends (%(default)s)"
    )
    p.add_argument(
        "--prompt-tokens", type=int, default=128, help="the decode's prompt (%(default)s)"
    )
    p.add_argument("--new-tokens", type=int, default=64, help="tokens decoded (%(default)s)")
    p.add_argument(
        "--repeats", type=int, default=5, help="runs of each, the median kept (%(default)s)"
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers comparison")
    p.add_argument("--json", help="also write the results here")
    return p


def _versus_hf(report: dict, folder, model, prompt, new_tokens: int, ours) -> None:
    ours_tps, ours_out = ours
    hf_tps, hf_out = hf_decode(folder, model.dtype, prompt, new_tokens)
    same = next((i for i, (a, b) in enumerate(zip(ours_out, hf_out, strict=False)) if a != b), None)
    report["decode_tokens_per_s"]["transformers"] = round(hf_tps, 3)
    report["decode_ratio_vs_transformers"] = round(ours_tps / hf_tps, 3)
    report["first_divergence_vs_transformers"] = same
    print(
        f"decode batch 1: transformers {hf_tps:.2f} tok/s -> ratio {ours_tps / hf_tps:.2f}x"
        f" (first differing token: {same})"
    )


def _verification(report: dict, model, context: int, repeats: int) -> None:
    curve = verification_curve(model, context, (1, 2, 4, 6, 8, 16), repeats)
    base = curve[1]
    report["verification_seconds"] = {n: round(t, 4) for n, t in curve.items()}
    report["verification_ratio"] = {n: round(t / base, 3) for n, t in curve.items()}
    print(f"verification cost, context {context}:")
    for n, t in curve.items():
        print(f"  +{n:>2} tokens: {t * 1000:7.1f} ms  {t / base:5.2f}x")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    folder = resolve(args.model)
    model = load_model(folder, dtype=args.dtype, weights=args.weights)
    threads = torch.get_num_threads()
    print(f"model {folder.name} weights {model.weights} dtype {model.dtype} threads {threads}")
    g = torch.Generator().manual_seed(1)
    vocab = model.args.vocab_size
    prompt = torch.randint(vocab // 8, vocab, (args.prompt_tokens,), generator=g).tolist()
    report: dict = {
        "model": folder.name,
        "weights": model.weights,
        "dtype": str(model.dtype),
        "threads": threads,
    }
    ours = ours_decode(model, prompt, args.new_tokens)
    report["decode_tokens_per_s"] = {"specd": round(ours[0], 3)}
    print(f"decode batch 1: specd {ours[0]:.2f} tok/s")
    if not args.no_hf:
        _versus_hf(report, folder, model, prompt, args.new_tokens, ours)
    _verification(report, model, args.context, args.repeats)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
