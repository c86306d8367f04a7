"""The speculation controller: per step, draft only where the predicted tokens/s beat plain.

For the B decoding sequences of one step, drafting k_s tokens for sequence s predicts

    tokens(k) = sum_s E_s(k_s),   E(k) = 1 + sum_{j=1..k} prod_{i=1..j} a_i
    time(k)   = sum_d P(max_s d_s = d) T(B, d) + S(k) / H

a_i: the chance that draft position i is accepted once positions < i were (per route);
d_s <= k_s: the drafts a round planned at k_s brings (the drafter stops after an unsure
draft: `Candidate.goes_on`); T(B, d): a whole decode step of B sequences whose deepest
round brought d drafts, measured online (costs.py), or, not measured yet, the forward by
rows plus a drafter round (optimistic, so such a step runs and measures itself), and where
every round may be an n-gram lookup (each route's share L_s of rounds), prod_s L_s of it a
lookup step's price instead (the forward and what no draft model running leaves); S: what
switching costs (the drafter catching up for those that start, drafting ahead for those
that stop), spread over H, the steps they may run so (remaining tokens / E, at most
`horizon`). Plain is tokens = B, time = T(B, 0) + S(0) / H: a tie per step is no reason
to flip, as every flip pays S.

The controller takes the k with the best tokens/time for every sequence of the step at
once (one known under its route's `min_acceptance` left out: `Candidate.under_floor`)
where it beats plain (a tie runs plain) and leaves none of the sequences it lets draft
slower than plain: E_s(k_s) / time(k) >= 1 / time(0) for each (`_fair`), so one route's
high acceptance does not buy a deep step that another route's requests pay for. One
episode of `explore_steps` in `explore_every` steps runs the least measured k predicted
within `explore_window` of the best (narrowing as 1 / sqrt(1 + its episodes)) or never
measured at this batch size, as a budget allows. Nothing latches: acceptance decays with time toward
a prior, and a sequence off for acceptance probes one k = 1 round in `probe_every`. Without
the cost model (`cost_model` False) every eligible sequence drafts its cap. Pure Python:
the unit tests feed it recorded timings.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from operator import getitem
from typing import NamedTuple

from specd.speculation_config import SpeculationConfig
from verifier_service.speculation.acceptance import PositionAcceptance
from verifier_service.speculation.costs import StepCostModel
from verifier_service.speculation.route_acceptance import RouteAcceptance
from verifier_service.speculation.step_shape import Candidate, Fixed, arm_shapes, step_shape


@dataclass(frozen=True)
class Plan:
    ks: list[int]  # drafts per candidate, in order
    reasons: list[str]  # per candidate: "on", "probe", "off:cost", "off:acceptance"
    gain: float  # predicted tokens/s of the plan over plain decoding (1.0: plain)
    # what the step is expected to emit and take, a switch included (0.0: not priced)
    tokens: float = 0.0
    seconds: float = 0.0


NOTHING_FIXED = Fixed()  # a step of candidates only


class Arm(NamedTuple):
    """One k for every candidate of a step (each at min(k, its cap)) beside the rest."""

    shape: tuple[int, list[float], float, int, float]  # as `step_shape` gives it
    tokens: float  # expected tokens of the step
    step_s: float  # expected seconds of the step
    switch_s: float  # what switching to it costs, whole
    spread_s: float  # that, spread over the steps it may run

    @property
    def seconds(self) -> float:
        """The step and its share of the switch."""
        return self.step_s + self.spread_s

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class Controller:
    """Owns the measured costs; `plan` decides one step."""

    def __init__(
        self, config: SpeculationConfig | None = None, cost_model: bool = True, clock=time.monotonic
    ):
        """`cost_model` False: every eligible sequence drafts its cap (no prices)."""
        self.config = config or SpeculationConfig()
        self.cost_model = cost_model
        self.costs = StepCostModel(self.config)
        self.routes = RouteAcceptance(self.config, clock)
        self._goes_on: dict[str, PositionAcceptance] = {}  # per route: c_i (`Candidate`)
        self._lookups: dict[str, PositionAcceptance] = {}  # per route: rounds a lookup drafted
        self._exploring: tuple[int, int, int] | None = None  # (sequences, k, steps left)
        self._since_explore = 0
        self._episodes: dict[tuple[int, int], int] = {}  # (B, k): episodes run
        self.budget_s = self.config.explore_cap_s  # what exploring and probing may spend
        # a plan prices the same steps more than once (each candidate at a good
        # acceptance, each alone): their expected seconds by shape, and the arms' steps by
        # candidates (`_arm_steps`), kept for one plan
        self._priced: dict[tuple, float] = {}
        self._stepped: dict[tuple, list] = {}

    def route_rates(self, route: str) -> list[float]:
        """A route's a_i over the prior: every sequence of the route drafts by it (one
        estimate per route and step serves all of them)."""
        c = self.config
        return self.routes.estimate(route, [c.prior_acceptance], c.prior_strength)

    def route_upper(self, route: str, first: float) -> float:
        """A route's a_1 upper bound (RouteAcceptance.upper) from `first`, its a_1 as
        `route_rates` gave it: what its floor is held against."""
        return self.routes.upper(route, first, self.config.prior_strength)

    def goes_on(self, route: str) -> list[float]:
        """A route's c_i (`Candidate.goes_on`), over a prior of always (1.0)."""
        counts = self._goes_on.get(route)
        return [] if counts is None else counts.rates([1.0], self.config.prior_strength)

    def lookups(self, route: str) -> float:
        """A route's share of drafted rounds an n-gram lookup drafted (`Candidate.lookup`),
        over a prior of none."""
        counts = self._lookups.get(route)
        return 0.0 if counts is None else counts.rates([0.0], self.config.prior_strength)[0]

    def record(
        self, route: str, k: int, accepted: int, drafted: int | None = None, lookup: bool = False
    ) -> None:
        """One decode round of a sequence on `route`, planned at k drafts, of which
        `drafted` came (default k), by a `lookup` or the draft model. The estimates learn
        the round as planned: where the drafter stopped short (its p_min), the position
        after its last draft counts as missed, so E(k) is what a round planned at k
        yields, as the step cost it is divided by is what such rounds took
        (docs/benchmarks-log.md section 44)."""
        if k <= 0:
            return
        self.routes.record(route, k, accepted, drafted)
        came = k if drafted is None else drafted
        if came > 0:  # a Bernoulli count: one position, hit where a lookup drafted
            lookups = self._lookups.setdefault(route, PositionAcceptance())
            lookups.record(1, int(lookup))
            lookups.limit(self.config.route_long_rounds)
        if k > 1 and came > 0:
            # position i: i + 1 drafts came with room for more; a hit if another did
            goes_on = self._goes_on.setdefault(route, PositionAcceptance())
            goes_on.record(k - 1, came - 1)
            goes_on.limit(self.config.route_long_rounds)

    def state(self) -> tuple:
        """What planning changes (the budget, the exploring episode and its count), for
        `restore`: a plan made ahead and not used gives it back."""
        return self.budget_s, self._exploring, self._since_explore, dict(self._episodes)

    def restore(self, state: tuple) -> None:
        self.budget_s, self._exploring, self._since_explore, self._episodes = state

    def plan(
        self, candidates: list[Candidate], fixed: Fixed = NOTHING_FIXED, dip: bool = False
    ) -> Plan:
        """Drafts per candidate for one step, beside the `fixed` rest of the batch.

        `dip`: the batch was larger a moment ago, or sequences wait to join it, so a plan
        for this smaller batch may last only a step or two: nothing explores, and where a
        candidate is more tokens behind the drafter than its round may draft (its cap) the
        whole step runs plain, since catching it up would not pay back before the batch
        returns (a few tokens ride in its round's first draft forward; sections 46, 55).

        A candidate left at k = 0 is `off:cost` when it would draft alone (the batch makes
        drafting too dear) or when the step would not draft even if every candidate
        accepted `good_acceptance` (the device and the batch make it too dear), and
        `off:acceptance` under its route's floor or when acceptance is what keeps it
        plain: only those probe, so probing never adds to a loaded batch. In a `dip` where
        one would have to catch the drafter up, every candidate is `off:cost` and nothing
        probes (a probe would catch up too)."""
        if not candidates:
            return Plan([], [], 1.0)
        self._priced, self._stepped = {}, {}  # the prices hold while it plans
        eligible = [_capped(c) if c.under_floor else c for c in candidates]
        cfg = self.config
        costs = self.cost_model
        if costs and dip and any(c.behind > c.cap for c in candidates):
            return Plan([0] * len(candidates), ["off:cost"] * len(candidates), 1.0)
        arm = None
        if costs:
            ks, gain, arm = self._choose(eligible, fixed, dip)
        else:
            ks, gain = [c.cap for c in eligible], 1.0
        reasons, good = [], None
        for i, c in enumerate(candidates):
            if ks[i]:
                reasons.append("on")
                continue
            if good is None and costs:
                good = self._drafts_at(candidates, fixed, cfg.good_acceptance)
            # off for cost: the device or the batch (`c` alone would draft) keeps it plain
            if eligible[i].cap and (not costs or not good or self._drafts_at([c])):
                reasons.append("off:cost")
            elif c.probe and c.cap:
                reasons.append("probe")
            else:
                reasons.append("off:acceptance")
        probes = [i for i, r in enumerate(reasons) if r == "probe"]
        if probes and (not costs or self._pay_probes(candidates, ks, probes, fixed)):
            for i in probes:
                ks[i] = 1
            arm = None  # not the step it priced
        else:
            reasons = ["off:acceptance" if r == "probe" else r for r in reasons]
        if arm is None or not self._known(arm):
            return Plan(ks, reasons, gain)  # not priced, or priced at a placeholder
        return Plan(ks, reasons, gain, arm.tokens, arm.step_s + arm.switch_s)

    def _pay_probes(
        self, candidates: list[Candidate], ks: list[int], probes: list[int], fixed: Fixed
    ) -> bool:
        """Whether the budget pays for these k = 1 probes: the step's added seconds and
        the drafter's catch-up for them (a probe of 8 behind a plain batch of 8 costs ~8
        plain steps on the 2-core CPU, one of 1 sequence ~1)."""
        probing = [1 if i in probes else k for i, k in enumerate(ks)]
        cost = self._step_s(candidates, probing, fixed) - self._step_s(candidates, ks, fixed)
        cost += self.costs.switch_s(sum(candidates[i].behind for i in probes), 0)
        if cost > self.budget_s:
            return False
        self.budget_s -= max(cost, 0.0)
        return True

    def _choose(
        self, candidates: list[Candidate], fixed: Fixed, dip: bool = False
    ) -> tuple[list[int], float, Arm]:
        """The arm (k) for this step, or an exploring episode's;
        -> (ks per candidate, predicted gain over plain, the arm)."""
        cfg, sequences = self.config, fixed.sequences + len(candidates)
        arms = self._arms(candidates, fixed)
        rates, fair = [a.rate for a in arms], _fair(candidates, arms)
        arm = _best(rates, fair)
        step_s = arms[arm].step_s
        cap = min(cfg.explore_cap_s, cfg.explore_cap_steps * step_s)
        self.budget_s = min(cap, self.budget_s + cfg.explore_share * step_s)
        if not dip:
            arm = self._explore(sequences, candidates, arms, arm)
        ks = [min(arm, c.cap) for c in candidates]
        return ks, (rates[arm] / rates[0] if rates[0] > 0 else 1.0), arms[arm]

    def _explore(
        self, sequences: int, candidates: list[Candidate], arms: list[Arm], arm: int
    ) -> int:
        """`arm`, or the k of an exploring episode: the least measured k at this batch
        size among those predicted within `_explore_floor` of the best or never measured
        nor tried there (`_untried`: a guess too pessimistic would otherwise never be
        tried), once the budget pays for what the episode is predicted to lose against
        `arm`. Not near the sequences' ends: no steps are left to use what it finds."""
        cfg, steps = self.config, self.costs.steps
        if self._exploring is not None and self._exploring[0] == sequences:
            _, k, left = self._exploring
            self._exploring = (sequences, k, left - 1) if left > 1 else None
            return min(k, len(arms) - 1)
        self._exploring = None
        self._since_explore += 1
        if cfg.explore_every <= 0 or self._since_explore < cfg.explore_every:
            return arm
        remaining = [c.remaining for c in candidates if c.remaining]
        if remaining and sum(remaining) < cfg.horizon * len(remaining):
            return arm
        self._since_explore = 0
        best = max(a.rate for a in arms)
        near = [
            k
            for k, a in enumerate(arms)
            if k != arm
            and (self._untried(sequences, k) or a.rate >= self._explore_floor(sequences, k) * best)
        ]
        if not near:
            return arm
        k = min(near, key=lambda k: (steps.samples(sequences, k), k))
        cost = self._episode_s(arms[k], arms[arm].rate)
        if cost > self.budget_s:
            return arm
        self.budget_s -= cost
        self._episodes[(sequences, k)] = self._episodes.get((sequences, k), 0) + 1
        if cfg.explore_steps > 1:
            self._exploring = (sequences, k, cfg.explore_steps - 1)
        return k

    def _untried(self, sequences: int, k: int) -> bool:
        """Whether no measured step prices k at this batch size and no episode has tried
        it: an episode whose steps measure nothing (a lookup's drafts price no step) is not
        run again for that."""
        return self.costs.steps(sequences, k) is None and not self._episodes.get((sequences, k))

    def _explore_floor(self, sequences: int, k: int) -> float:
        """The share of the best predicted rate that k must reach to be explored at this
        batch size: `explore_window`, narrowing as 1 / sqrt(1 + its episodes there), as the
        error of a mean over them does."""
        return 1 - self.config.explore_window / math.sqrt(1 + self._episodes.get((sequences, k), 0))

    def _episode_s(self, episode: Arm, rate: float) -> float:
        """Seconds an episode is predicted to lose against running at `rate`: its steps
        beyond the time `rate` would take for their tokens (nothing where nothing prices
        them), and its switch whole (an episode is too short to spread it)."""
        loss = 0.0
        if rate > 0 and self._known(episode):
            loss = self.config.explore_steps * (episode.step_s - episode.tokens / rate)
        return max(loss, 0.0) + episode.switch_s

    def _known(self, arm: Arm) -> bool:
        """Whether the arm's step is measured or composed, not the placeholder price."""
        sequences, reach_max, rows, *_ = arm.shape
        return self.costs.known(sequences, len(reach_max), rows)

    def _drafts_at(
        self, candidates: list[Candidate], fixed: Fixed = NOTHING_FIXED, accept: float | None = None
    ) -> bool:
        """Whether the candidates would draft beside `fixed` (each at `accept` instead of
        its own acceptance if given)."""
        if accept is not None:
            candidates = [c.at(accept) for c in candidates]
        arms = self._arms(candidates, fixed)
        return _best([a.rate for a in arms], _fair(candidates, arms)) > 0

    def _arms(self, candidates: list[Candidate], fixed: Fixed) -> list[Arm]:
        """The step with every candidate at min(k, its cap), k = 0..the largest cap."""
        arms, expected = [], [c.expected for c in candidates]
        for ks, shape, step_s, switch in self._arm_steps(candidates, fixed):
            tokens = fixed.tokens + sum(map(getitem, expected, ks))
            spread = switch / self._horizon(candidates, ks) if switch else 0.0
            arms.append(Arm(shape, tokens, step_s, switch, spread))
        return arms

    def _arm_steps(
        self, candidates: list[Candidate], fixed: Fixed
    ) -> list[tuple[list[int], tuple, float, float]]:
        """Each arm's (ks, shape, expected seconds, switch price): nothing of them depends
        on acceptance, so a plan that prices its step again at another (the reasons) takes
        them as they are. Which candidates draft is the same at every k > 0, and so is
        what switching costs."""
        key = (fixed, tuple(c.step_key for c in candidates))
        if key in self._stepped:
            return self._stepped[key]
        plain, drafting = [0] * len(candidates), [c.cap for c in candidates]
        switches = [self.costs.switch_s(*_switching(candidates, ks)) for ks in (plain, drafting)]
        steps = []
        for k, shape in enumerate(arm_shapes(candidates, fixed)):
            ks = [min(k, c.cap) for c in candidates]
            steps.append((ks, shape, self._expected_s(*shape), switches[min(k, 1)]))
        self._stepped[key] = steps
        return steps

    def _horizon(self, candidates: list[Candidate], ks: list[int]) -> float:
        """The steps a switch to `ks` is spread over: the candidates' mean remaining tokens
        at these k, in steps, from 1 up to `horizon`."""
        pairs = zip(candidates, ks, strict=True)
        steps = [c.remaining / c.expected[k] for c, k in pairs if c.remaining]
        if not steps:
            return self.config.horizon
        return min(self.config.horizon, max(1.0, sum(steps) / len(steps)))

    def _step_s(self, candidates: list[Candidate], ks: list[int], fixed: Fixed) -> float:
        return self._expected_s(*step_shape(candidates, ks, fixed))

    def _expected_s(
        self, sequences: int, reach_max: list[float], rows: float, drafting: int, lookups: float
    ) -> float:
        """The expected step: its price at each depth its deepest round may reach, by the
        chance of that depth (steps are not affine in the drafts: k = 1 pays a round's
        fixed part), and where every round may be a lookup (no draft model runs), a
        lookup step's price by that chance."""
        key = (sequences, tuple(reach_max), rows, drafting, lookups)
        if key in self._priced:
            return self._priced[key]
        if not reach_max:
            total = self.costs(sequences, 0, rows, drafting)
        else:
            total, p_next = 0.0, 0.0
            for j in range(len(reach_max), 0, -1):  # P(deepest = j) = P(>= j) - P(>= j + 1)
                p = reach_max[j - 1] - p_next
                p_next = reach_max[j - 1]
                if p > 1e-9:
                    total += p * self.costs(sequences, j, rows, drafting)
            lookup_s = self.costs.lookup_s(sequences, rows) if lookups else None
            if lookup_s is not None:
                total += lookups * (lookup_s - total)
        self._priced[key] = total
        return total


def _best(rates: list[float], fair: list[bool]) -> int:
    """The k whose predicted tokens/s (`rates[k]`, k = 0 plain) is best among the `fair`
    drafting ones, where it beats plain's; else 0 (a tie runs plain)."""
    best = max((k for k in range(1, len(rates)) if fair[k]), key=lambda k: rates[k], default=0)
    return best if best and rates[best] > rates[0] else 0


def _fair(candidates: list[Candidate], arms: list[Arm]) -> list[bool]:
    """Per arm, whether every candidate it lets draft is predicted at least the tokens/s it
    would have plain: E_s(min(k, cap_s)) / seconds(k) >= 1 / seconds(0) (`Arm.seconds`).
    Sequences of one route share its estimates, so a step of one route that
    beats plain passes; a step of routes apart may not (code drafting deep beside chat). A
    candidate whose tokens left end in this round is not held to it: its last step."""
    plain = arms[0].seconds
    held = [c for c in candidates if c.cap and not (c.remaining and c.remaining <= c.cap + 1)]
    return [
        not k or all(c.expected[min(k, c.cap)] * plain >= arm.seconds for c in held)
        for k, arm in enumerate(arms)
    ]


def _capped(c: Candidate) -> Candidate:
    """`c` kept plain this step (under its route's floor): every other field as it is, so
    one that was already plain is not priced as stopping."""
    return replace(c, cap=0)


def _switching(candidates: list[Candidate], ks: list[int]) -> tuple[int, int]:
    """(tokens the drafter catches up on for those that start drafting, how many stop)."""
    behind = sum(c.behind for c, k in zip(candidates, ks, strict=True) if k)
    stopping = sum(1 for c, k in zip(candidates, ks, strict=True) if not k and not c.behind)
    return behind, stopping
