"""`specd bench controller`: the speculation controller on simulated traffic, offline.

    specd bench controller [--trials 24] [--phases] [--ks 2,3]
    specd bench controller --workload chat --ks 0,1,2 [--step-ms 44.4,65.1,84.1,104.8]
                           [--p-min 0.7]

One sequence at a time (c = 1) decodes requests of 64 tokens. Each step is planned by the
engine's own speculation control (`SpeculationControl.plan`) on a real `Sequence` (route
bound `min_acceptance` 0.5, as deploy/policy.yaml) and reported to it as the engine
reports it (`observe`): the round's accepted drafts, the whole step's seconds, the
drafter's catch-up (the step's parts are not simulated: reported as 0, not measured).
Fixed k runs the same requests on routes of their own, in alternating order (as `specd
bench sweep --modes on@ROUTE,auto` does), and the report is `auto`'s tokens/s over each
fixed k's, per trial and on average.

The model of the text is greedy speculation's: at output position t the draft model's
token matches the target's with a probability set by a two-state Markov chain (text being
copied, ~0.97; new text, ~0.78; a switch every ~8 tokens), and a round of k drafts
started at t accepts min(L(t), k), L(t) being the run of matches from t. The defaults
reproduce code at c = 1 on the AVX2 CPU of docs/benchmarks-log.md section 40: position 0 accepts
0.87, k = 3 2.29 drafts a round. A step's seconds are that machine's medians by k (whole
steps: drafter round, forward, verification) with 8% noise, and with `--phases` a slow
walk of the machine's speed within +-25%, as that machine did. Every mode sees the same
texts (common random numbers), so the ratios measure the controller, not the draw.

With `--workload`, the texts are recorded instead (`specd bench matches`: where the
default drafter's greedy token was the target's on each of that workload's prompts), each
cell cycling through its prompts as `specd bench sweep` sends them, from an offset drawn
per trial. Before the cells, every mode runs each prompt's first 8 tokens, as the sweep's
warm-up does. `--step-ms` replaces the step costs (ms by k = 0, 1, ...; past the last, on
the line through the last two). There a round also stops where the drafter's recorded
probability of its draft is under `--p-min` (the drafter's default; 0: never): a step
planned at k drafts min(k, stop) and costs the step of that many, and the engine's
accounting follows (the step's price under its planned k, the acceptance under its drafts).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
from pathlib import Path

from bench.prompts import WARM_UP_TOKENS
from specd.config import DrafterConfig, EngineConfig
from specd.speculation_config import SpeculationConfig
from verifier_service.records import RoundReport, SeqView, StepReport, StepView
from verifier_service.request import Request, SpeculationBounds
from verifier_service.sequence import Sequence
from verifier_service.speculation import SpeculationControl

# whole decode steps at c = 1 by k, seconds (docs/benchmarks-log.md section 40, cluster 2's medians)
FIRST_ROUND_S = 0.05  # a request's first round catches the drafter up on its prompt
BACK_S = 0.004  # and a sequence back from plain, per token it skipped (up to 10)
PROMPT_TOKENS = 200
MIN_ACCEPTANCE = 0.5  # deploy/policy.yaml's default route bound
TRACES = Path(__file__).parent / "workloads" / "matches.json"  # `specd bench matches`
NEVER = 8  # a round's drafts before p_min stops it, where nothing stops it (> any cap)


def match_runs(rnd: random.Random, tokens: int, copied=0.97, new=0.78, switch=0.12) -> list[int]:
    """L(t) for t < tokens: how many drafts in a row from position t the target accepts."""
    copying, matches = rnd.random() < 0.5, []
    for _ in range(tokens + 8):
        if rnd.random() < switch:
            copying = not copying
        matches.append(rnd.random() < (copied if copying else new))
    return runs_from(matches, range(tokens))


def runs_from(matches, starts) -> list[int]:
    """For each t in `starts`, the run of matches from t (at most 8, more than any cap)."""
    runs = []
    for t in starts:
        run = 0
        while run < 8 and t + run < len(matches) and matches[t + run]:
            run += 1
        runs.append(run)
    return runs


def recorded_runs(matches: list[int]) -> list[int]:
    """L(t) for the decode steps of a recorded text: output token 0 comes from the
    prefill, so the steps start at t = 1 and a round there accepts the run of matches."""
    return runs_from(matches, range(1, len(matches)))


def recorded_stops(confidence: list[float], p_min: float) -> list[int]:
    """For the decode steps t >= 1: the drafts a round from t makes before p_min stops it,
    the unsure one included (at most NEVER)."""
    stops = []
    for t in range(1, len(confidence)):
        n = 1
        while n < NEVER and t + n < len(confidence) and confidence[t + n - 1] >= p_min:
            n += 1
        stops.append(n)
    return stops


def load_traces(
    workload: str, path: Path = TRACES, p_min: float = DrafterConfig.p_min
) -> list[list[tuple[int, int]]]:
    """A workload's recorded texts as (run, stop) by decode step (texts too short to
    decode dropped)."""
    traces = json.loads(path.read_text())
    texts = zip(traces["workloads"][workload], traces["confidence"][workload], strict=True)
    return [
        list(zip(recorded_runs(m), recorded_stops(c, p_min), strict=True))
        for m, c in texts
        if len(m) > 2
    ]


def step_table(ms: list[float]) -> dict[int, float]:
    """Seconds by k = 0..NEVER from ms by k = 0.. (past the last, on the line of the last
    two)."""
    s = [x / 1000 for x in ms]
    slope = s[-1] - s[-2] if len(s) > 1 else 0.0
    return {k: s[k] if k < len(s) else s[-1] + slope * (k - len(s) + 1) for k in range(NEVER + 1)}


# whole decode steps at c = 1 by k, seconds (docs/benchmarks-log.md section 40, cluster 2's medians)
STEP_S = step_table([35.2, 62.6, 78.6, 98.9, 129.2, 149.3, 166.4])


class Machine:
    """A step's seconds: the medians, 8% noise, and a speed that wanders with time."""

    def __init__(self, seed: int, phases: bool, steps: dict[int, float] | None = None):
        self.steps = steps or STEP_S
        self.rnd = random.Random(seed)
        self.clock = 0.0
        walk, self.speed = random.Random(seed + 1), [1.0]
        for _ in range(1000):
            step = self.speed[-1] * math.exp(walk.gauss(0, 0.05)) if phases else 1.0
            self.speed.append(min(1.25, max(0.8, step)))

    def step(self, k: int) -> float:
        seconds = self.steps[k] * self.step_scale()
        self.clock += seconds
        return seconds

    def step_scale(self) -> float:
        """The machine's speed now, times one step's noise."""
        phase = self.speed[min(int(self.clock / 10), len(self.speed) - 1)]
        return phase * math.exp(self.rnd.gauss(0, 0.08))


def run_cell(control: SpeculationControl, texts: list, mode, machine: Machine, cap: int):
    """Decode every text ((run, stop) by step) at c = 1 with `mode` ("auto" or a fixed k);
    -> tokens/s. Each step goes through the engine's `plan` and `observe` doors with a
    real `Sequence`, so probes, the drafter's catch-up and the caps are the engine's own."""
    auto = mode == "auto"
    route = "code" if auto else f"code_k{mode}"
    bounds = SpeculationBounds(auto=auto, route=route, min_acceptance=MIN_ACCEPTANCE)
    seconds, tokens = 0.0, 0
    for i, text in enumerate(texts):
        request = Request([1] * PROMPT_TOKENS, max_new_tokens=len(text) + 1,
                          num_draft=cap if auto else mode, speculation=bounds)  # fmt: skip
        seq = Sequence.start(i, request, eos_ids=())
        seq.append([7])  # the prefill's token
        while not seq.finish_reason:
            plan = control.plan(StepView((SeqView.of(seq),), batch=1, kv_used=0.0))
            k, reason, _ = plan.decisions[0]
            run, stop = text[seq.num_generated - 1]
            drafts = min(k, stop)
            accepted = min(run, drafts)
            took = machine.step(drafts)
            behind = seq.drafter_behind
            if k and behind:  # the drafter's catch-up, on the machine's clock too
                catch_up = FIRST_ROUND_S if not seq.stats.rounds else BACK_S * min(behind - 1, 10)
                machine.clock += catch_up
                took += catch_up
            seq.decided(reason, k)
            seq.stats.record(drafts, accepted)
            tokens += len(seq.append([7] * (accepted + 1)))
            r = RoundReport(seq.seq_id, route, True, k, drafts, accepted, k > 0, False,
                            1 + drafts, behind)  # fmt: skip
            control.observe(StepReport((r,), step_s=took))
            seconds += took
    return tokens / seconds


def cell_texts(recorded: list, rnd: random.Random, cells: int, requests: int) -> list[list]:
    """Each cell's `requests` texts, cycling through the recorded ones as `specd bench
    sweep` sends its prompts, from an offset drawn by `rnd`."""
    start = rnd.randrange(len(recorded))
    return [
        [recorded[(start + c * requests + i) % len(recorded)] for i in range(requests)]
        for c in range(cells)
    ]


def trial(
    seed: int,
    ks=(2, 3),
    cells=2,
    requests=16,
    tokens=64,
    cap=6,
    phases=False,
    recorded: list | None = None,
    steps: dict[int, float] | None = None,
    config: SpeculationConfig | None = None,
) -> dict:
    """One sweep: `cells` rounds of every mode in alternating order, one controller (as
    one verifier serves them all), on Markov texts (no round stops short) or on `recorded`
    ones (then with the sweep's warm-up first); -> mean tokens/s by mode."""
    if recorded is None:
        texts = [
            [
                [(r, NEVER) for r in match_runs(random.Random(seed * 1000 + c * 100 + i), tokens)]
                for i in range(requests)
            ]
            for c in range(cells)
        ]
    else:
        texts = cell_texts(recorded, random.Random(seed), cells, requests)
    machine = Machine(seed, phases, steps)
    # the control's clock is the machine's (the routes' half-life counts simulated seconds)
    control = SpeculationControl(
        EngineConfig(speculation=config or SpeculationConfig()), clock=lambda: machine.clock
    )
    modes = (*ks, "auto")
    if recorded is not None:
        for mode in modes:
            run_cell(control, [r[:WARM_UP_TOKENS] for r in recorded], mode, machine, cap)
    rates: dict = {m: [] for m in modes}
    for cell in range(cells):
        for mode in modes if cell % 2 == 0 else modes[::-1]:
            rates[mode].append(run_cell(control, texts[cell], mode, machine, cap))
    return {m: statistics.mean(v) for m, v in rates.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specd bench controller", description=__doc__.split("\n")[0])
    p.add_argument("--trials", type=int, default=24, help="simulated runs a setting (%(default)s)")
    p.add_argument("--ks", default="2,3", help="fixed k to run beside auto (%(default)s)")
    p.add_argument("--phases", action="store_true", help="the machine's speed wanders")
    p.add_argument("--workload", help="replay this workload's recorded texts (chat, code, ...)")
    p.add_argument("--step-ms", help="a step's ms by k = 0, 1, ... (default: section 40's)")
    p.add_argument(
        "--p-min",
        type=float,
        default=DrafterConfig.p_min,
        help="with --workload: as the drafter's (%(default)s)",
    )
    args = p.parse_args(argv)
    ks = tuple(int(k) for k in args.ks.split(","))
    recorded = load_traces(args.workload, p_min=args.p_min) if args.workload else None
    steps = step_table([float(x) for x in args.step_ms.split(",")]) if args.step_ms else None
    results = [
        trial(s, ks, phases=args.phases, recorded=recorded, steps=steps) for s in range(args.trials)
    ]
    for mode in (*ks, "auto"):
        print(f"{mode!s:>5}: {statistics.mean(r[mode] for r in results):.2f} tok/s")
    best = [r["auto"] / max(r[k] for k in ks) for r in results]
    print(f"auto / best fixed: mean {statistics.mean(best):.3f}, min {min(best):.3f}")
    for k in ks:
        print(f"auto / k = {k}: {statistics.mean(r['auto'] / r[k] for r in results):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
