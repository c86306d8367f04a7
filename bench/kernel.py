"""`specd bench kernel`: one weight matrix's matmul, per format and row count.

    specd bench kernel [--shape 8960,1536] [--rows 1,4,7,16] [--copies 28]

Times bf16 (`W @ X^T`), fp32 through MKL (`W @ X^T`) and through specd's dispatch (oneDNN),
torch's int4 kernel and specd's int4/int6/int8 kernel on `--copies`
random matrices (enough to defeat the cache: every call reads DRAM, as a decode step does),
and says whether a row's result is bitwise the same alone and inside the batch.
"""

from __future__ import annotations

import argparse
import time

import torch

from specd.models import native
from specd.models import qlinear as ql
from specd.models.matmul import linear


def _activations(w) -> torch.dtype:
    """fp32 weights multiply fp32 rows; every other format bf16 rows."""
    return torch.float32 if getattr(w, "dtype", None) == torch.float32 else torch.bfloat16


def _time(fn, weights, rows: int, k: int) -> float:
    x = torch.randn(rows, k, dtype=_activations(weights[0]))
    for w in weights:
        fn(x, w)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for w in weights:
            fn(x, w)
        best = min(best, (time.perf_counter() - start) / len(weights))
    return best * 1e3


def _invariant(fn, w, k: int) -> bool:
    x = torch.randn(7, k, dtype=_activations(w))
    return torch.equal(fn(x[:1], w), fn(x, w)[:1])


def candidates(n: int, k: int, copies: int):
    dense = [torch.randn(n, k, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    yield "bf16", lambda x, w: torch.mm(w, x.t()).t(), dense
    dense32 = [w.float() for w in dense]
    yield "fp32 MKL", lambda x, w: torch.mm(w, x.t()).t(), dense32
    yield "fp32 specd (oneDNN)", linear, dense32
    del dense32  # twice the bf16 copies' memory: gone before the quantised ones are built
    packed = [
        (
            torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                torch.randint(0, 16, (n, k), dtype=torch.int32), 1
            ),
            torch.randn(k // 32, n, 2, dtype=torch.bfloat16) * 0.01,
        )
        for _ in range(copies)
    ]
    yield (
        "torch int4",
        lambda x, w: torch.ops.aten._weight_int4pack_mm_for_cpu(x, w[0], 32, w[1]),
        packed,
    )
    if native.kernel() is not None:
        for bits in (4, 6, 8):
            mats = [ql.quantize(w, bits) for w in dense]
            yield f"specd int{bits}", ql.qlinear, mats


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specd bench kernel", description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="8960,1536", help="the matrix's OUT,IN (%(default)s)")
    p.add_argument("--rows", default="1,4,7,16", help="row counts, comma-separated (%(default)s)")
    p.add_argument(
        "--copies",
        type=int,
        default=28,
        help="matrices, so that each call reads DRAM (%(default)s)",
    )
    args = p.parse_args(argv)
    n, k = (int(v) for v in args.shape.split(","))
    rows = [int(r) for r in args.rows.split(",")]
    print(f"[{n}, {k}] x {args.copies} copies, {torch.get_num_threads()} threads, ms per call")
    print("| format | " + " | ".join(f"{r} rows" for r in rows) + " | row-invariant |")
    print("| --- | " + " | ".join("---" for _ in rows) + " | --- |")
    for name, fn, weights in candidates(n, k, args.copies):
        times = " | ".join(f"{_time(fn, weights, r, k):.3f}" for r in rows)
        print(f"| {name} | {times} | {_invariant(fn, weights[0], k)} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
