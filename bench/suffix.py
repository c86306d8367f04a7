"""`specd bench suffix`: the suffix drafter's shared memory at scale, offline.

    specd bench suffix [--tokens 100000] [--lookups 2000]

Fills one route's memory (drafter_service/suffix.py) with responses drawn from the shipped
workloads' recorded texts' token statistics (random ids with repeats, as code repeats
itself) up to `--tokens`, then times lookups of contexts that end like a stored response
(the hit path: candidates scored and voted on) and of contexts that match nothing.
Reports the median and p99 per lookup, and the memory's size.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from drafter_service.suffix import ResponseIndex


def responses(rnd: random.Random, total: int, vocab: int = 32000) -> list[list[int]]:
    """Responses of 50-400 tokens; a third repeat a piece of an earlier one, as edits do."""
    out, size = [], 0
    while size < total:
        n = rnd.randint(50, 400)
        if out and rnd.random() < 0.33:
            src = rnd.choice(out)
            start = rnd.randrange(max(1, len(src) - 40))
            piece = src[start : start + 40]
            r = [rnd.randrange(vocab) for _ in range(n // 2)] + piece
            r += [rnd.randrange(vocab) for _ in range(n - len(r))]
        else:
            r = [rnd.randrange(vocab) for _ in range(n)]
        out.append(r)
        size += len(r)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specd bench suffix", description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=100_000, help="tokens in the memory (%(default)s)")
    p.add_argument("--lookups", type=int, default=2000, help="lookups timed (%(default)s)")
    p.add_argument("--k", type=int, default=8, help="drafts a lookup may give (%(default)s)")
    args = p.parse_args(argv)
    rnd = random.Random(0)
    stored = responses(rnd, args.tokens)
    index = ResponseIndex(max_tokens=args.tokens + 1000)
    started = time.perf_counter()
    for r in stored:
        index.add(r)
    fill_s = time.perf_counter() - started
    for name, hit in (("hit", True), ("miss", False)):
        times, drafted = [], 0
        for _ in range(args.lookups):
            if hit:
                r = rnd.choice(stored)
                end = rnd.randrange(10, len(r) - 1)
                context = [rnd.randrange(32000) for _ in range(20)] + r[end - 10 : end]
            else:
                context = [rnd.randrange(32000) for _ in range(30)]
            t0 = time.perf_counter()
            drafted += len(index.continuation(context, args.k).tokens)
            times.append(time.perf_counter() - t0)
        times.sort()
        print(
            f"{name:4}: median {statistics.median(times) * 1e6:.0f} us, "
            f"p99 {times[int(0.99 * len(times))] * 1e6:.0f} us, "
            f"{drafted / args.lookups:.2f} drafts a lookup"
        )
    keys = sum(len(v) for v in index.index.values())
    print(
        f"memory: {index.tokens} tokens in {len(index.docs)} responses, {keys} index entries; "
        f"filled in {fill_s:.2f} s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
