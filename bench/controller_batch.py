"""`specd bench controller-batch`: the speculation controller at a batch, offline: the goal
sweep's cells (`auto` against fixed k, c = 1, 2, 4, 8, 16 clients) on recorded texts.

    specd bench controller-batch [--workload code] [--ks 0,3,6] [--trials 8] [--phases]
                                 [--steps bench/workloads/steps.json | gpu.json]
                                 [--explore-every 0 ...: the verifier's control flags]

c closed-loop clients share a cell's requests (16 of a workload's recorded texts): each
sends its next request `gap` seconds after its last one ended (drawn around `--gap-ms`: a
client's round trip and the router's admission, the dip the controller must ride out).
A request joins the batch as a prefill round (its prompt found in the prefix cache, as the
sweep's warm-up leaves it), then decodes; every step is planned and reported through the
engine's own `SpeculationControl` doors, on real `Sequence`s, as controller_sim.py does at
c = 1. What each sequence accepts and where its drafter stops are the recorded texts'.

A step's seconds come from a table of whole decode steps measured on the real pair by
(sequences, depth) (`specd bench steps`: forward, drafter round and the rest): the forward
by the rows the step feeds, the drafter round by the sequences drafting and the deepest
round, the rest by sequences; 8% noise, and with `--phases` the machine's slow walk. The
drafter's catch-up costs what the table measured a first round to add (else what
controller_sim.py charges). The parts are reported as the engine reports them, so the
controller composes prices for shapes it has not run.
"""

from __future__ import annotations

import argparse
import bisect
import json
import random
import statistics
from collections import deque
from pathlib import Path

from bench.controller_sim import BACK_S, FIRST_ROUND_S, PROMPT_TOKENS, Machine, cell_texts
from bench.prompts import WARM_UP_TOKENS
from router.policy import Policy, RoutePolicy
from specd.config import ConfigError, EngineConfig
from specd.config_flags import add_arguments, from_arguments
from specd.speculation_config import SpeculationConfig
from verifier_service.records import RoundReport, SeqView, StepReport, StepView
from verifier_service.request import Request, SpeculationBounds
from verifier_service.sequence import Sequence
from verifier_service.speculation import SpeculationControl

STEPS = Path(__file__).parent / "workloads" / "steps.json"  # `specd bench steps`
POLICY = Path(__file__).parents[1] / "deploy" / "policy.yaml"  # what `specd up` serves
PREFILL_S = 0.01  # a prompt found in the prefix cache: its last token's row


def _interp(points: list[tuple[float, float]], x: float) -> float:
    """Piecewise linear through sorted (x, y), on along the end segments past the ends."""
    if len(points) == 1:
        return points[0][1]
    xs = [p[0] for p in points]
    i = min(max(bisect.bisect_left(xs, x), 1), len(points) - 1)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


class StepTable:
    """Seconds of a decode step's parts, from whole steps measured by (sequences, depth):
    the forward by rows (over every measured step), the drafter round by (sequences
    drafting, depth), the rest by sequences."""

    def __init__(
        self, measured: dict[str, dict], first_round_s: float | None = None, served_s: float = 0.0
    ):
        # what serving adds to a step a sequence, beyond the engine's own: the verifier's
        # event loop, the router and the client streaming its tokens, on the same cores
        self.served_s = served_s
        # a request's first drafting round catches its drafter up on the prompt; a later
        # one on the tokens it skipped, each at the share of that which the CPU's took
        self.first_round_s = FIRST_ROUND_S if first_round_s is None else first_round_s
        self.back_s = BACK_S * self.first_round_s / FIRST_ROUND_S
        by = {tuple(map(int, key.split(","))): v for key, v in measured.items()}
        rows: dict[float, list[float]] = {}
        for v in by.values():
            rows.setdefault(v["rows"], []).append(v["forward"])
        self.forward_by_rows = sorted((r, statistics.median(f)) for r, f in rows.items())
        self.sizes = sorted({b for b, _ in by})
        self.draft = {  # by depth, from no round at depth 0
            b: [(0, 0.0), *sorted((d, by[b, d]["draft"]) for bb, d in by if bb == b and d)]
            for b in self.sizes
        }
        rest = {b: [v["step"] - v["forward"] - v["draft"] for (bb, _), v in by.items() if bb == b]
                for b in self.sizes}  # fmt: skip
        self.rest = [(b, statistics.median(r)) for b, r in rest.items()]

    @classmethod
    def load(cls, path: Path = STEPS, served_s: float = 0.0) -> StepTable:
        """`specd bench steps`' table, or the one in `specd bench gpu`'s report."""
        data = json.loads(Path(path).read_text())
        return cls(data["steps"], data.get("first_round_s"), served_s)

    def catch_up_s(self, behind: int, first: bool) -> float:
        """What catching the drafter up adds to a drafting round."""
        return self.first_round_s if first else self.back_s * min(behind - 1, 10)

    def parts(self, sequences: int, rows: int, drafting: int, depth: int) -> tuple[float, ...]:
        """(forward, drafter round, the rest) of a decode step."""
        draft = 0.0
        if drafting and depth:
            by_size = [(b, _interp(self.draft[b], depth)) for b in self.sizes]
            draft = _interp(by_size, drafting)
        rest = _interp(self.rest, sequences) + self.served_s * sequences
        return _interp(self.forward_by_rows, rows), draft, rest


def run_cell(control, texts, mode, machine: Machine, table: StepTable, clients: int, gap_s: float,
             rnd: random.Random, policy: RoutePolicy, first_id: int = 0) -> float:  # fmt: skip
    """Decode `texts` ((run, stop) by step) with `clients` closed-loop clients in `mode`
    ("auto", under the route's `policy` as the router sends it, or a fixed k); -> tokens/s
    over the cell."""
    bounds, cap = _bounds(mode, policy)
    queue = deque(enumerate(texts, first_id))
    start = machine.clock
    arrivals = [start] * min(clients, len(texts))  # when each idle client's next request comes
    running: list[tuple[Sequence, list]] = []
    tokens = 0
    while queue or running:
        joining = []
        while queue and arrivals and min(arrivals) <= machine.clock:
            arrivals.remove(min(arrivals))
            i, text = queue.popleft()
            request = Request([1] * PROMPT_TOKENS, max_new_tokens=len(text) + 1,
                              num_draft=cap, speculation=bounds)  # fmt: skip
            joining.append((Sequence.start(i, request, eos_ids=()), text))
        if not running and not joining:
            machine.clock = min(arrivals)  # nothing runs until the next request comes
            continue
        view = StepView(tuple(SeqView.of(s) for s, _ in running), len(running) + len(joining), 0.0)
        decisions = control.plan(view).decisions if running else ()
        rounds, catch_up = [], 0.0
        for (seq, text), (k, reason, _) in zip(running, decisions, strict=True):
            report, behind_s = _decode(seq, text, k, reason, table)
            rounds.append(report)
            catch_up += behind_s
        for seq, _ in joining:
            seq.append([7])  # the prefill's token
            rounds.append(RoundReport(seq.seq_id, bounds.route, False, 0, 0, 0, False, False, 1, 0))
        report = _step(table, machine, rounds, catch_up)
        machine.clock += report.step_s
        control.observe(report)
        tokens += sum(r.accepted + 1 for r in rounds)
        running += joining
        for seq, text in list(running):
            if seq.finish_reason:
                running.remove((seq, text))
                arrivals.append(machine.clock + gap_s * rnd.uniform(0.5, 1.5))
    return tokens / (machine.clock - start)


def _bounds(mode, policy: RoutePolicy) -> tuple[SpeculationBounds, int]:
    """What the router sends for `mode`: `auto` under the route's policy, or a fixed k."""
    if mode != "auto":
        return SpeculationBounds(route=f"k{mode}"), mode
    bounds = SpeculationBounds(auto=True, route="auto", min_acceptance=policy.min_acceptance,
                               draft_below_batch=policy.max_batch_size,
                               max_kv_utilization=policy.max_kv_utilization)  # fmt: skip
    return bounds, policy.num_draft_tokens


def _decode(seq: Sequence, text: list, k: int, reason: str, table: StepTable):
    """One sequence's round as its recorded text accepts it (every draft up to its
    drafter's stop, the run of matches of them); -> its report and the drafter's catch-up
    seconds."""
    run, stop = text[seq.num_generated - 1]
    drafts = min(k, stop)
    accepted = min(run, drafts)
    behind, catch_up = seq.drafter_behind, 0.0
    if k and behind:
        catch_up = table.catch_up_s(behind, first=not seq.stats.rounds)
    seq.decided(reason, k)
    seq.stats.record(drafts, accepted)
    seq.append([7] * (accepted + 1))
    report = RoundReport(seq.seq_id, seq.speculation.route, True, k, drafts, accepted, k > 0,
                         False, 1 + drafts, behind)  # fmt: skip
    return report, catch_up


def _step(table: StepTable, machine: Machine, rounds: list, catch_up: float) -> StepReport:
    """The step's parts from the table, at the machine's speed and noise, the catch-up in
    the drafter's round, and a prefill round's row beside them."""
    decode = [r for r in rounds if r.decode]
    depth = max((r.drafted for r in decode), default=0)
    drafting = sum(1 for r in decode if r.drafted)
    rows = sum(r.rows for r in rounds)
    forward, draft, rest = table.parts(len(rounds), rows, drafting, depth)
    scale = machine.step_scale()
    forward_s, draft_s = forward * scale, draft * scale + catch_up
    step_s = forward_s + draft_s + rest * scale + PREFILL_S * (len(rounds) - len(decode))
    return StepReport(tuple(rounds), draft_s, forward_s, step_s)


def trial(seed: int, levels, recorded: list, policy: RoutePolicy, ks=(0, 3), cells=2,
          requests=16, gap_s=0.1, phases=False, table: StepTable | None = None,
          config: SpeculationConfig | None = None) -> dict[int, dict]:  # fmt: skip
    """One sweep on one controller (one verifier serves it all), as `specd bench sweep
    --concurrency` runs it: the warm-up, then at each level of clients in turn `cells`
    rounds of every mode in alternating order; -> tokens/s by mode, by level."""
    table = table or StepTable.load()
    rnd = random.Random(seed)
    texts = cell_texts(recorded, rnd, cells, requests)
    machine = Machine(seed, phases)
    # the control's clock is the machine's: its batch memory and the routes' half-life
    # count simulated seconds, as a verifier's count its own
    control = SpeculationControl(
        EngineConfig(speculation=config or SpeculationConfig()), clock=lambda: machine.clock
    )
    modes = (*ks, "auto")
    ids = iter(range(0, 10**9, 1000))

    def run(texts, mode, clients: int) -> float:
        return run_cell(control, texts, mode, machine, table, clients, gap_s, rnd, policy,
                        next(ids))  # fmt: skip

    for mode in modes:
        run([r[:WARM_UP_TOKENS] for r in recorded], mode, 1)
    out = {}
    for clients in levels:
        rates: dict = {m: [] for m in modes}
        for cell in range(cells):
            for mode in modes if cell % 2 == 0 else modes[::-1]:
                rates[mode].append(run(texts[cell], mode, clients))
        out[clients] = {m: statistics.mean(v) for m, v in rates.items()}
    return out


def main(argv: list[str] | None = None) -> int:
    from bench import flags
    from bench.controller_sim import load_traces

    p = argparse.ArgumentParser(prog="specd bench controller-batch",
                                description=__doc__.split("\n")[0])  # fmt: skip
    p.add_argument("--workload", default="code", help="recorded texts to replay (%(default)s)")
    p.add_argument("--route", help="`auto`'s route in --policy (default: the workload's name)")
    p.add_argument("--policy", default=str(POLICY), help="the router's policy (%(default)s)")
    p.add_argument("--concurrency", default="1,2,4,8,16", help=flags.CONCURRENCY)
    p.add_argument("--ks", default="0,3,6", help="fixed k to run beside auto (%(default)s)")
    p.add_argument("--trials", type=int, default=8, help="simulated runs a cell (%(default)s)")
    p.add_argument(
        "--gap-ms",
        type=float,
        default=100.0,
        help="a client's pause between requests, on average (%(default)s)",
    )
    p.add_argument("--phases", action="store_true", help="the machine's speed wanders")
    p.add_argument(
        "--served-ms",
        type=float,
        default=0.0,
        help="what serving adds to a step a sequence beyond the in-process engine's (the "
        "router and clients on the same cores; 3 on a 2-core CPU, log section 88; %(default)s)",
    )
    p.add_argument(
        "--steps",
        default=str(STEPS),
        help="`specd bench steps`' table, or `specd bench gpu`'s report (%(default)s)",
    )
    control = p.add_argument_group("the control", "as `specd serve verifier` takes them")
    add_arguments(p, SpeculationConfig, into=control)
    args = p.parse_args(argv)
    try:
        config = from_arguments(SpeculationConfig, args)
    except ConfigError as exc:
        p.error(str(exc))
    ks = tuple(int(k) for k in args.ks.split(","))
    recorded = load_traces(args.workload)
    table = StepTable.load(args.steps, args.served_ms / 1000)
    _, policy, unknown = Policy.load(args.policy).for_route(args.route or args.workload)
    if unknown:
        p.error(unknown)
    levels = [int(c) for c in args.concurrency.split(",")]
    sweeps = [trial(s, levels, recorded, policy, ks, gap_s=args.gap_ms / 1000,
                    phases=args.phases, table=table, config=config)
              for s in range(args.trials)]  # fmt: skip
    for clients in levels:
        runs = [sweep[clients] for sweep in sweeps]
        best = [r["auto"] / max(r[k] for k in ks) for r in runs]
        rates = ", ".join(f"{m}: {statistics.mean(r[m] for r in runs):.1f}" for m in (*ks, "auto"))
        print(f"c = {clients}: auto / best fixed {statistics.geometric_mean(best):.3f} "
              f"(min {min(best):.3f}); tok/s {rates}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
