"""Where a decode step's time goes on the GPU: the kernels of one step under the torch
profiler (eagerly: the same kernels a graph replays), then a step's wall time eager and
replayed, 1 and k + 1 rows.

    python -m bench.gpu.profile [--shape llama-3.2-3b] [--context 512]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.gpu.shapes import SHAPES, build
from specd.models.paged_kv import PagedKV
from specd.models.seq_input import SeqInput


def _step_ms(model, kv, rows: int, context: int, repeats: int = 30) -> float:
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        model.forward(kv, [SeqInput(0, [7] * rows, num_logits=rows)])
        model.synchronize()
        samples.append(time.perf_counter() - t0)
        kv.allocator.truncate_to(0, context)
    return statistics.median(samples[3:]) * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu.profile")
    p.add_argument(
        "--shape",
        default="llama-3.2-3b",
        choices=sorted(SHAPES),
        help="random weights of this model's shapes (%(default)s)",
    )
    p.add_argument("--context", type=int, default=512, help="tokens in the cache (%(default)s)")
    args = p.parse_args(argv)
    _, model = build(args.shape, "cuda", torch.bfloat16)
    kv = PagedKV.for_model(model, -(-(args.context + 16) // 16) + 1)
    kv.allocator.allocate(0)
    model.forward(kv, [SeqInput(0, [11] * args.context)])
    eager = {n: _step_ms(model, kv, n, args.context) for n in (1, 5)}
    model.prepare_steps(kv, max_seqs=1, max_rows=8)
    graphs = {n: _step_ms(model, kv, n, args.context) for n in (1, 5)}
    print(f"{args.shape}, context {args.context}: step ms eager {eager}, from graphs {graphs}")
    model.gpu.graphs = None
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        _step_ms(model, kv, 1, args.context, repeats=5)
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=20)
    print("kernels of 5 eager one-row steps, by GPU time:")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
