"""The speculation control, with two doors: `plan(view)` decides the step (which sequences
draft, at which k, why, and how many alternative leaves the step may verify), and
`observe(report)` learns from what the step did (the drafts accepted, what its parts
took). Nothing else of it is reached from outside, and nothing else writes what it has
learned.

Per decoding sequence, in order: a bounded one runs plain where the batch is past the
smallest batch bound in it (`_tightest`) or the KV pool past its route's bound;
an `auto` request's k comes from the controller (verifier_service/speculation/
controller.py), which prices the step from measured costs and acceptance; any other
drafts what it asked. The request's k comes bounded by the engine's `max_draft_tokens`
(Engine.add_request); the plan bounds it by the tokens left and decides within that.
"""

from __future__ import annotations

import math
import time
from collections import deque

from specd.config import INVARIANT_TILE, EngineConfig
from verifier_service.records import (
    Decision,
    Observed,
    RoundReport,
    SeqView,
    StepPlan,
    StepReport,
    StepView,
)
from verifier_service.speculation.controller import Controller
from verifier_service.speculation.costs import CostCurve
from verifier_service.speculation.step_shape import Candidate, Fixed


class SpeculationControl:
    def __init__(self, config: EngineConfig, clock=time.monotonic):
        self.config = config
        self.tuned = config.speculation
        self.clock = clock
        self.controller = Controller(self.tuned, config.cost_model, clock)
        self._batch_history: deque[tuple[float, int]] = deque()
        self._rates: dict[str, float] | None = None  # accepted / drafted by route, as observed
        # the next step planned ahead: (the view it expects, its plan, the controller's
        # planning state before it), and how many plans were taken from there
        self._ahead: tuple[StepView, StepPlan, tuple] | None = None
        self.planned_ahead = 0

    # -- the doors -----------------------------------------------------------------------------
    def plan(self, view: StepView) -> StepPlan:
        """The step's plan: the one planned ahead where `view` is the view it expected, else
        planned now (what planning ahead spent, the exploring and probing budget, given
        back first)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            expected, plan, state = ahead
            if _as_expected(expected, view):
                self.planned_ahead += 1
                return plan
            self.controller.restore(state)
        return self._plan(view)

    def plan_ahead(self, view: StepView) -> None:
        """The plan door a step early: on a device whose forward returns queued (a GPU's),
        the next step is planned while this one computes, from the view this step should
        leave (`SeqView.after`), so that the next `plan` costs nothing where it does. What
        it reads of the learned state is then a step older, as what it plans is."""
        state = self.controller.state()
        self._ahead = (view, self._plan(view), state)

    def observe(self, report: StepReport) -> Observed:
        learned = [r for r in report.rounds if r.accepted is not None]
        for r in learned:
            self._learn_round(r)
        self._learn_costs(report)
        if self._rates is None or any(r.drafted for r in learned):  # rates move with rounds
            self._rates = self.controller.routes.rates()
        return Observed(self._rates, self.controller.costs.steps.pace)

    # -- plan ----------------------------------------------------------------------------------
    def _plan(self, view: StepView) -> StepPlan:
        decisions, expected = self._decide(view)
        return StepPlan(tuple(decisions), self._leaves(decisions), expected)

    def _decide(self, view: StepView) -> tuple[list[Decision], tuple[float, float] | None]:
        """Each ready sequence's decision, and the (tokens, seconds) the controller expects
        of the step where it priced it."""
        recent = self._recent_batch(view.batch)
        controller = self.controller
        routes = dict.fromkeys(seq.key for seq in view.ready)
        accept = {route: controller.route_rates(route) for route in routes}
        upper = {route: controller.route_upper(route, accept[route][0]) for route in routes}
        goes_on = {route: controller.goes_on(route) for route in routes}
        lookups = {route: controller.lookups(route) for route in routes}
        held = recent >= _tightest(view.ready)  # past a bound in the batch: bounded ones plain
        decided: dict[int, Decision] = {}
        candidates: dict[int, Candidate] = {}
        for i, seq in enumerate(view.ready):
            bounds, k = seq.bounds, _most(seq)
            if not k:
                decided[i] = Decision(0, "off:request", 1.0)
            elif held and (bounds.auto or bounds.draft_below_batch):
                decided[i] = Decision(0, "off:batch", 1.0)
            elif view.kv_used > bounds.max_kv_utilization:
                decided[i] = Decision(0, "off:kv", 1.0)
            elif bounds.auto:
                route, probe = seq.key, seq.off_steps + 1 >= self.tuned.probe_every
                candidates[i] = Candidate(
                    k, accept[route], probe, bounds.min_acceptance, seq.behind, seq.remaining,
                    goes_on[route], lookups[route], upper[route],
                )  # fmt: skip
            else:
                decided[i] = Decision(k, "on", 1.0)
        if not candidates:  # nothing for the controller to plan
            return [decided[i] for i in range(len(view.ready))], None
        routed = [(view.ready[i].key, d.k) for i, d in decided.items()]
        rest = Fixed.of([(accept[route], goes_on[route], k) for route, k in routed])
        # fewer ready than the batch had a moment ago (or than run and wait now): a dip
        plan = controller.plan(list(candidates.values()), rest, dip=recent > len(view.ready))
        for i, k, reason in zip(candidates, plan.ks, plan.reasons, strict=True):
            decided[i] = Decision(k, reason, plan.gain)
        expected = (plan.tokens, plan.seconds) if plan.seconds else None
        return [decided[i] for i in range(len(view.ready))], expected

    def _recent_batch(self, size: int) -> int:
        """The largest batch over the last `batch_memory_s`: a one-step dip (a
        request finished, the next not yet admitted) must not switch the whole batch to
        drafting, whose catch-up forward costs more than that step gains."""
        now, history = self.clock(), self._batch_history
        while history and history[-1][1] <= size:  # outlived by a batch as large: never the most
            history.pop()
        history.append((now, size))
        while history[0][0] < now - self.tuned.batch_memory_s:
            history.popleft()
        return history[0][1]

    def _leaves(self, decisions: list[Decision]) -> int:
        """Alternative leaves the step may hold: one beside each draft, up to
        `max_tree_tokens` new tokens (in batch-invariant mode a sequence's tree then fits
        its one query tile), and with the cost model only as many as the measured forward
        says come nearly free."""
        limit = self.config.max_tree_tokens
        if self.config.batch_invariant:
            limit = min(limit, INVARIANT_TILE)
        drafts = sum(d.k for d in decisions)
        chain = len(decisions) + drafts
        # at most one leaf beside each draft (Scheduler._schedule_decode): rows past those
        # are never fed, and a price read there must not buy the leaves that are
        room = max(0, min(limit - chain, drafts))
        if self.config.cost_model:
            room = free_rows(self.controller.costs.steps.forward, chain, room, self.tuned.leaf_cost)
        return room

    # -- observe -------------------------------------------------------------------------------
    def _learn_round(self, r: RoundReport) -> None:
        """The controller learns a round as planned (a round the drafter stopped short
        missed the position after its last draft), as its step costs are measured."""
        planned = r.planned if r.drafted else 0  # drafts come only to decode rounds of k > 0
        self.controller.record(r.route, planned, r.accepted, r.drafted, r.ngram)

    def _learn_costs(self, report: StepReport) -> None:
        """The step's parts: a steady drafter round by sequences (not where the drafter
        caught up first, on a new prompt or tokens decoded plain, which the switch curve
        prices; nor where every round was an n-gram lookup), the forward by rows where the
        step was decode and verification only (prefill apart), and the whole step by the
        drafts that came (`_step_shape`), its forward apart; one whose every round was a
        lookup by its sequences alone (what no draft model running costs)."""
        rounds = report.rounds
        if not rounds:
            return
        costs = self.controller.costs
        catch_up = sum(r.behind for r in rounds if r.planned)
        lookup = _lookup_only(rounds)
        drafted = [r.drafted for r in rounds if r.proposed]
        if not (catch_up or lookup):
            costs.record_draft(len(drafted), max(drafted, default=0), report.draft_s)
        rows = sum(r.rows for r in rounds)
        if all(r.decode for r in rounds):
            costs.record_forward(rows, report.forward_s)
        shape = _step_shape(rounds, catch_up)
        if shape is None:
            return
        if not lookup:
            ks, stopping = shape
            costs.record_step(ks, report.step_s, catch_up, stopping, rows, report.forward_s)
        elif not catch_up:
            costs.record_lookup(len(rounds), report.step_s, report.forward_s)


def _tightest(ready: tuple[SeqView, ...]) -> float:
    """The smallest batch bound of the ready sequences' routes (none: no bound). A drafting
    step is slower for every sequence in it, so a route's bound holds the whole batch
    plain, not only its own sequences: a route held plain beside drafting ones would run
    slower than plain decoding (as vLLM's `disable_by_batch_size` holds every sequence)."""
    return min(
        (s.bounds.draft_below_batch for s in ready if s.bounds.draft_below_batch), default=math.inf
    )


def _most(seq: SeqView) -> int:
    """The most drafts a sequence may verify: what it asked, within its tokens left (the
    token after the last draft is always sampled)."""
    return max(0, min(seq.asked, seq.remaining - 1))


def _as_expected(expected: StepView, view: StepView) -> bool:
    """Whether a step planned ahead is this one: the same sequences in the same order and
    batch, each with the bounds, k, steps off and drafter's lag expected, and on the same
    side of its KV and tokens-left bounds. Tokens left and what was learned may move a
    step's worth; anything else is a step not planned for."""
    if expected.batch != view.batch or len(expected.ready) != len(view.ready):
        return False
    for e, v in zip(expected.ready, view.ready, strict=True):
        if (e.seq_id, e.asked, e.off_steps, e.behind, _most(e)) != (
            v.seq_id, v.asked, v.off_steps, v.behind, _most(v)
        ):  # fmt: skip
            return False
        kv = e.bounds.max_kv_utilization
        if e.bounds != v.bounds or (expected.kv_used > kv) != (view.kv_used > kv):
            return False
    return True


def free_rows(forward: CostCurve, rows: int, extra: int, leaf_cost: float) -> int:
    """How many of `extra` leaf rows beside `rows` are worth their cost. A leaf yields a
    token only where its draft is rejected and it is not: ~1.6% more tokens a round per leaf
    on code, 5% on chat, so a leaf may add `leaf_cost` of the forward, no more. What a row
    adds is the slope of the least-squares line through the measured sizes up to the
    leaves' (one size's price is as noisy as what a leaf is worth, and a dip read there
    would give one k its leaves and not the next: docs/benchmarks-log.md section 110).
    Where rows are flat (a GPU, AMX) every leaf passes; on an AVX2 CPU a row costs ~0.38
    of a one-row step. `forward` is a drafting step's forward by rows (StepCosts.forward),
    every size held at one pace: two sizes learned while the machine ran at different
    speeds must not price a leaf. Nothing measured, or one size alone up to the leaves'
    rows, every leaf is taken, and the forward measures what they cost; a chain shorter
    than every size measured takes none, and measures itself."""
    smallest = forward.smallest
    if smallest is None:
        return extra
    if rows < smallest:
        return 0
    while extra:
        mx, my, slope = forward.line(rows + extra)
        if slope <= leaf_cost * (my + slope * (rows - mx)):
            break
        extra -= 1
    return extra


def _lookup_only(rounds: tuple[RoundReport, ...]) -> bool:
    """Whether the step drafted and every round's drafts were an n-gram continuation: no
    draft model ran, so neither the drafter round nor the whole step says what a round of
    the draft model costs (priced with the others, they cut the price of whichever depth
    was running)."""
    drafted = [r for r in rounds if r.proposed and r.drafted]
    return bool(drafted) and all(r.ngram for r in drafted)


def _step_shape(rounds: tuple[RoundReport, ...], catch_up: int) -> tuple[list[int], int] | None:
    """What a whole decode step's cost is measured by: the drafts that came for each
    sequence (a round planned at k comes short where the drafter stops early; the
    controller prices a plan by how deep its rounds are expected to go), and how many
    switch to plain after drafting (the drafter still drafts ahead for them); the
    catch-up of those switching to drafting is the caller's. None when the step was not
    decode only (prefill costs apart), or when a round planned to draft got nothing (a
    drafter that failed or timed out: neither a plain nor a drafting step's price)."""
    if not all(r.decode for r in rounds) or any(r.planned and not r.drafted for r in rounds):
        return None
    stopping = sum(1 for r in rounds if not r.planned and not r.behind)
    return [r.drafted for r in rounds], stopping
