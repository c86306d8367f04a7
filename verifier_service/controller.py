"""The speculation controller: per step, draft only when the predicted tokens/s beat plain.

For the decoding sequences of one step, drafting k tokens for sequence s (k_s <= its
route's k) predicts

    tokens(k) = sum_s E_s(k_s),   E(k) = 1 + sum_{j=1..k} prod_{i=1..j} a_i
    time(k)   = T(rows) + D(k),   rows = sum_s (1 + k_s)

with a_i the probability that draft position i is accepted once positions < i were
(measured per route and per sequence), T the forward's cost by row count and D a drafter
round of k steps (both measured online). Plain decoding is tokens = B, time = T(B). The
controller takes the k with the best tokens/time, for every sequence of the step at once
(only a sequence under its route's `min_acceptance` is left out), with hysteresis: from
plain it needs `margin` better, once drafting it stays until `off_margin` worse. This cost
model is optional (`ControllerConfig.costs`, the engine's `cost_model`, off by default):
at 4 concurrent code requests it still chose plain or small k where drafting the route's k
gained ~10% (BENCHMARKS.md section 11). Without it, every eligible sequence drafts its cap.

Nothing latches: acceptance decays with time back toward a prior, and a route that is off
for acceptance still probes one round in `probe_every` at k = 1, so it measures again and
comes back by itself. Pure Python (no torch): the unit tests feed it recorded timings.
"""

from __future__ import annotations

from dataclasses import dataclass

from verifier_service.acceptance import PositionAcceptance, expected_tokens
from verifier_service.costs import CostCurve
from verifier_service.route_acceptance import RouteAcceptance


@dataclass
class Candidate:
    """One decoding sequence of an `auto` request, as the controller sees it."""

    cap: int  # the most drafts the route and the sequence allow this step
    accept: list[float]  # a_i by position
    probe: bool = False  # due a probe round if it is off for acceptance
    floor: float = 0.0  # the route's min_acceptance: below it a_1 is off for acceptance


@dataclass(frozen=True)
class Plan:
    ks: list[int]  # drafts per candidate, in order
    reasons: list[str]  # per candidate: "on", "probe", "off:cost", "off:acceptance"
    gain: float  # predicted tokens/s of the plan over plain decoding (1.0: plain)


@dataclass
class ControllerConfig:
    costs: bool = True  # False: every eligible sequence drafts its cap (no cost model)
    margin: float = 0.05  # plain -> drafting when drafting predicts >= (1 + margin) x plain
    off_margin: float = 0.10  # drafting -> plain when it predicts < (1 - off_margin) x plain
    prior_acceptance: float = 0.7  # a_i before any round on a route
    prior_strength: float = 2.0  # how many rounds the prior weighs
    route_strength: float = 4.0  # how many rounds a route's estimate weighs for a sequence
    probe_every: int = 16  # while off for acceptance: one k = 1 round in this many steps


class Controller:
    """Owns the measured costs; `plan` decides one step."""

    def __init__(self, config: ControllerConfig | None = None):
        self.config = config or ControllerConfig()
        self.forward = CostCurve()  # seconds per decode-only forward, by rows
        # seconds per drafter round, by draft steps (k), one curve per sequences in the
        # round: a round has a fixed part (the catch-up of accepted tokens, the round trip)
        # that a per-step average would charge to every step, and so undervalue long k
        self.draft: dict[int, CostCurve] = {}
        self.routes = RouteAcceptance()
        # the last step's plan drafted (for the hysteresis); a route's `auto` starts on
        self.drafting = True

    def accept_rates(self, route: str, seq: PositionAcceptance) -> list[float]:
        c = self.config
        route_rates = self.routes.positions(route).rates([c.prior_acceptance], c.prior_strength)
        return seq.rates(route_rates, c.route_strength)

    def record_forward(self, rows: int, seconds: float) -> None:
        self.forward.record(rows, seconds)

    def record_draft(self, sequences: int, steps: int, seconds: float) -> None:
        if steps > 0 and sequences > 0:
            self.draft.setdefault(sequences, CostCurve()).record(steps, seconds)

    def plan(self, candidates: list[Candidate], fixed_rows: int, fixed_tokens: float) -> Plan:
        """Drafts per candidate for one step. `fixed_rows`/`fixed_tokens`: the rest of the
        batch (plain or forced-k sequences), which the decision does not change.

        A candidate left at k = 0 is `off:cost` when it would draft alone (the batch makes
        drafting too dear) and `off:acceptance` when not even alone, or below the route's
        `min_acceptance`: only those probe, so probing never adds to a loaded batch."""
        if not candidates:
            return Plan([], [], 1.0)
        eligible = [c if c.accept[0] >= c.floor else _capped(c) for c in candidates]
        # hysteresis: switching costs (the drafter catches up on what it skipped), and the
        # model errs by ~10% near break-even (at 4 sequences it kept choosing plain where
        # drafting gained 11%), so a drafting batch stays on until drafting predicts
        # `off_margin` worse than plain, and a plain one waits for `margin` better
        cfg = self.config
        if cfg.costs:
            threshold = -cfg.off_margin if self.drafting else cfg.margin
            ks, gain = self._best(eligible, fixed_rows, fixed_tokens, threshold)
        else:
            ks, gain = [c.cap for c in eligible], 1.0
        self.drafting = any(ks)
        reasons = []
        for i, c in enumerate(candidates):
            if ks[i]:
                reasons.append("on")
            elif eligible[i].cap and (not cfg.costs or self._best([c], 0, 0.0)[0][0]):
                reasons.append("off:cost")
            elif c.probe and c.cap:
                ks[i] = 1
                reasons.append("probe")
            else:
                reasons.append("off:acceptance")
        return Plan(ks, reasons, gain)

    def _best(self, candidates, fixed_rows, fixed_tokens, margin=None) -> tuple[list[int], float]:
        """The k (<= each cap) with the best predicted tokens/s, if it beats plain by
        `margin` (default: the config's); -> (ks, predicted gain over plain)."""
        margin = self.config.margin if margin is None else margin
        n = len(candidates)
        plain = [0] * n
        base = self._rate(candidates, plain, fixed_rows, fixed_tokens)
        if base <= 0:
            return plain, 1.0
        best, best_rate = plain, 0.0
        for k in range(1, max((c.cap for c in candidates), default=0) + 1):
            ks = [min(k, c.cap) for c in candidates]
            rate = self._rate(candidates, ks, fixed_rows, fixed_tokens)
            if rate > best_rate + 1e-12:
                best, best_rate = ks, rate
        if best is plain or best_rate < base * (1 + margin):
            return plain, 1.0
        return best, best_rate / base

    def _rate(self, candidates, ks, fixed_rows, fixed_tokens) -> float:
        tokens = fixed_tokens + sum(
            expected_tokens(c.accept, k) for c, k in zip(candidates, ks, strict=True)
        )
        rows = fixed_rows + sum(1 + k for k in ks)
        seconds = self._forward_s(rows)
        drafting = [k for k in ks if k]
        if drafting:
            seconds += self._draft_round_s(len(drafting), max(drafting), rows)
        return tokens / seconds if seconds > 0 else 0.0

    def _forward_s(self, rows: int) -> float:
        t = self.forward(rows)
        return 1.0 if t is None else t  # nothing measured yet: every size costs the same

    def _draft_round_s(self, sequences: int, steps: int, rows: int) -> float:
        """A drafter round of `steps` for `sequences`, from the round size measured nearest
        (the fewest sequences at or above, else the most below)."""
        if not self.draft:
            # before any round: a draft step guessed at a quarter of a forward
            return 0.25 * steps * self._forward_s(rows)
        sizes = sorted(self.draft)
        size = next((n for n in sizes if n >= sequences), sizes[-1])
        return self.draft[size](steps)


def _capped(c: Candidate) -> Candidate:
    return Candidate(0, c.accept, c.probe, c.floor)
