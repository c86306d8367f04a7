"""`specd bench controller`: the speculation controller on simulated traffic, offline.

    specd bench controller [--trials 24] [--phases] [--ks 2,3]

One sequence at a time (c = 1) decodes requests of `--tokens` tokens through the real
`Controller` (verifier_service/controller.py), fed as the engine feeds it: each step's
plan, its round's accepted drafts, its seconds. Fixed k runs the same requests on routes
of their own, in alternating order (as `specd bench sweep --modes on@ROUTE,auto` does),
and the report is `auto`'s tokens/s over each fixed k's, per trial and on average.

The model of the text is greedy speculation's: at output position t the draft model's
token matches the target's with a probability set by a two-state Markov chain (text being
copied, ~0.97; new text, ~0.78; a switch every ~8 tokens), and a round of k drafts
started at t accepts min(L(t), k), L(t) being the run of matches from t. The defaults
reproduce code at c = 1 on the AVX2 CPU of BENCHMARKS.md section 40: position 0 accepts
0.87, k = 3 2.29 drafts a round. A step's seconds are that machine's medians by k (whole
steps: drafter round, forward, verification) with 8% noise, and with `--phases` a slow
walk of the machine's speed within +-25%, as that machine did. Every mode sees the same
texts (common random numbers), so the ratios measure the controller, not the draw.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics

from verifier_service.acceptance import PositionAcceptance
from verifier_service.controller import Candidate, Controller

# whole decode steps at c = 1 by k, seconds (BENCHMARKS.md section 40, cluster 2's medians)
STEP_S = {0: 0.0352, 1: 0.0626, 2: 0.0786, 3: 0.0989, 4: 0.1292, 5: 0.1493, 6: 0.1664}
FIRST_ROUND_S = 0.05  # a request's first round catches the drafter up on its prompt
BACK_S = 0.004  # and a sequence back from plain, per token it skipped (up to 10)
PROMPT_TOKENS = 200


def match_runs(rnd: random.Random, tokens: int, copied=0.97, new=0.78, switch=0.12) -> list[int]:
    """L(t) for t < tokens: how many drafts in a row from position t the target accepts."""
    copying, matches = rnd.random() < 0.5, []
    for _ in range(tokens + 8):
        if rnd.random() < switch:
            copying = not copying
        matches.append(rnd.random() < (copied if copying else new))
    runs = []
    for t in range(tokens):
        run = 0
        while run < 8 and matches[t + run]:
            run += 1
        runs.append(run)
    return runs


class Machine:
    """A step's seconds: the medians, 8% noise, and a speed that wanders with time."""

    def __init__(self, seed: int, phases: bool):
        self.rnd = random.Random(seed)
        self.clock = 0.0
        walk, self.speed = random.Random(seed + 1), [1.0]
        for _ in range(1000):
            step = self.speed[-1] * math.exp(walk.gauss(0, 0.05)) if phases else 1.0
            self.speed.append(min(1.25, max(0.8, step)))

    def step(self, k: int) -> float:
        phase = self.speed[min(int(self.clock / 10), len(self.speed) - 1)]
        seconds = STEP_S[k] * phase * math.exp(self.rnd.gauss(0, 0.08))
        self.clock += seconds
        return seconds


def run_cell(c: Controller, texts: list[list[int]], mode, machine: Machine, cap: int) -> float:
    """Decode every text at c = 1 with `mode` ("auto" or a fixed k); -> tokens/s."""
    route = "code" if mode == "auto" else f"code_k{mode}"
    seconds = tokens = 0.0
    for runs in texts:
        seq, t, rounds, off, last = PositionAcceptance(), 0, 0, 0, 0
        while t < len(runs):
            remaining = len(runs) - t
            most = max(0, min(cap, remaining - 1))
            if mode != "auto":
                k = min(mode, most)
            elif most:
                behind = PROMPT_TOKENS + t if not rounds else (off + 1 if off else 0)
                due = off + 1 >= c.config.probe_every
                accept = c.accept_rates(c.route_rates(route), seq)
                k = c.plan([Candidate(most, accept, due, 0.5, behind, remaining)]).ks[0]
            else:
                k = 0
            accepted = min(runs[t], k)
            took = machine.step(k)
            catch_up = stopping = 0
            if k and not rounds:
                took += FIRST_ROUND_S
                catch_up = PROMPT_TOKENS + t
            elif k and off:
                took += BACK_S * min(off, 10)
                catch_up = off + 1
            elif not k and last:
                stopping = 1
            c.costs.record_step([k], took, catch_up, stopping)
            c.record(route, seq, k, accepted)
            rounds += bool(k)
            off, last = (0 if k else off + 1), k
            seconds += took
            tokens += accepted + 1
            t += accepted + 1
    return tokens / seconds


def trial(seed: int, ks=(2, 3), cells=2, requests=16, tokens=64, cap=6, phases=False) -> dict:
    """One sweep: `cells` rounds of every mode in alternating order, one controller (as
    one verifier serves them all); -> mean tokens/s by mode."""
    texts = [
        [match_runs(random.Random(seed * 1000 + cell * 100 + i), tokens) for i in range(requests)]
        for cell in range(cells)
    ]
    c, machine = Controller(), Machine(seed, phases)
    modes = (*ks, "auto")
    rates: dict = {m: [] for m in modes}
    for cell in range(cells):
        for mode in modes if cell % 2 == 0 else modes[::-1]:
            rates[mode].append(run_cell(c, texts[cell], mode, machine, cap))
    return {m: statistics.mean(v) for m, v in rates.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specd bench controller", description=__doc__.split("\n")[0])
    p.add_argument("--trials", type=int, default=24)
    p.add_argument("--ks", default="2,3", help="fixed k to run beside auto")
    p.add_argument("--phases", action="store_true", help="the machine's speed wanders")
    args = p.parse_args(argv)
    ks = tuple(int(k) for k in args.ks.split(","))
    results = [trial(s, ks, phases=args.phases) for s in range(args.trials)]
    for mode in (*ks, "auto"):
        print(f"{mode!s:>5}: {statistics.mean(r[mode] for r in results):.2f} tok/s")
    best = [r["auto"] / max(r[k] for k in ks) for r in results]
    print(f"auto / best fixed: mean {statistics.mean(best):.3f}, min {min(best):.3f}")
    for k in ks:
        print(f"auto / k = {k}: {statistics.mean(r['auto'] / r[k] for r in results):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
