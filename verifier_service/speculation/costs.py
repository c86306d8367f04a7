"""What steps cost, measured online, for the speculation controller (controller.py):
whole decode steps by (sequences, k), a drafting one's forward apart by rows; the parts a
step is composed of where no such step was measured yet (a forward by rows, a drafter
round by sequences and steps); a step whose rounds a lookup drafted (no draft model ran);
and what switching between drafting and plain adds.
Sections: docs/benchmarks-log.md's."""

from __future__ import annotations

import math
import statistics
from bisect import bisect_left

from specd.speculation_config import SpeculationConfig


class CostCurve:
    """Seconds per event by size (rows of a forward, sequences in a drafter round, drafts
    of a step): an EMA per size from its second event (the first may run cold), with its
    sample count. Between measured sizes it interpolates; below the smallest it is flat;
    past the largest it goes on along the line through the smallest and the largest, never
    down (the whole span: the last two sizes differ within their noise, section 54). With
    one size measured it is flat past it, or with `origin` goes on through zero (a drafter
    round of k steps is k forwards). With `extrapolate=False` it is unknown (None) outside
    the measured sizes. With `median`, a size's price is the median of its events since
    the second until the EMA would weigh each as little (a stall must not set it; section
    62)."""

    def __init__(
        self,
        weight: float = 0.3,
        extrapolate: bool = True,
        origin: bool = False,
        median: bool = False,
    ):
        self.weight = weight
        self.extrapolate = extrapolate
        self.origin = origin
        self.median = median
        self._by_size: dict[int, float] = {}
        self._counts: dict[int, int] = {}
        self._sizes: list[int] = []
        self._learning: dict[int, list[float]] = {}  # with `median`: samples since the second

    def record(self, size: int, seconds: float) -> None:
        if size <= 0 or not seconds > 0:
            return
        old, count = self._by_size.get(size), self._counts.get(size, 0)
        if old is None:
            self._by_size[size] = seconds
            self._sizes = sorted(self._by_size)
        elif count == 1:  # the first event of a size may run cold: the second replaces it
            self._by_size[size] = seconds
            if self.median:
                self._learning[size] = [seconds]
        elif self.median and count < 1 / self.weight:
            learning = self._learning[size]
            learning.append(seconds)
            self._by_size[size] = statistics.median(learning)
            if count + 1 >= 1 / self.weight:
                del self._learning[size]
        else:  # the mean since the second, until that weighs each less than the EMA does
            weight = max(self.weight, 1.0 / count)
            self._by_size[size] = old + weight * (seconds - old)
        self._counts[size] = count + 1

    def settle(self, size: int, ratio: float) -> None:
        """One more event of a size measured past its first mean (StepCosts: settled)
        that ran `ratio` x its price: the price moves by the EMA's weight in its
        logarithm (a geometric mean), not in seconds."""
        self._by_size[size] *= ratio**self.weight
        self._counts[size] += 1

    def samples(self, size: int) -> int:
        return self._counts.get(size, 0)

    @property
    def smallest(self) -> int | None:
        """The smallest size measured (None before any)."""
        return self._sizes[0] if self._sizes else None

    def __call__(self, size: int) -> float | None:
        sizes = self._sizes
        if not sizes:
            return None
        i = bisect_left(sizes, size)
        if i < len(sizes) and sizes[i] == size:
            return self._by_size[size]
        if i == 0 or i == len(sizes):
            if not self.extrapolate:
                return None
            lo, hi = sizes[0], sizes[-1]
            if i == 0:
                return self._by_size[lo]
            if lo == hi:
                return self._by_size[hi] * (size / hi if self.origin else 1.0)
            slope = max(0.0, (self._by_size[hi] - self._by_size[lo]) / (hi - lo))
            return self._by_size[hi] + slope * (size - hi)
        lo, hi = sizes[i - 1], sizes[i]
        f = (size - lo) / (hi - lo)
        return self._by_size[lo] * (1 - f) + self._by_size[hi] * f

    def measured(self) -> dict[int, float]:
        return dict(self._by_size)

    def line(self, upto: int | None = None) -> tuple[float, float, float]:
        """The least-squares line through the measured sizes, each weighing its samples
        (with `upto`, those up to the first measured at or past it): (mean size, mean
        seconds, seconds per size, never below 0); flat through one size, (0, 0, 0)
        through none."""
        i = len(self._sizes) if upto is None else bisect_left(self._sizes, upto) + 1
        points = {x: self._by_size[x] for x in self._sizes[:i]}
        w = {x: self._counts[x] for x in points}
        total = sum(w.values())
        if not total:
            return 0.0, 0.0, 0.0
        mx = sum(w[x] * x for x in points) / total
        my = sum(w[x] * y for x, y in points.items()) / total
        var = sum(w[x] * (x - mx) ** 2 for x in points)
        if var <= 0:
            return mx, my, 0.0
        return mx, my, max(0.0, sum(w[x] * (x - mx) * (y - my) for x, y in points.items()) / var)


class StepCosts:
    """Seconds per whole decode step by (sequences in the step, most drafts that came for
    any of them), as the engine ran it: drafter round, forward with its tree leaves,
    verification, commit (a sum of parts misses the leaves and the catch-up: section 19).

    Plain steps are one curve by sequences. A drafting step is its forward, by the rows it
    feeds, plus the rest of it (drafter round, verification, commit) by batch size and k:
    a price by (sequences, k) alone averages over the rows its rounds fed (a deepest round
    of 4 in a batch of 2 feeds 6 to 10 rows), and a forward is not affine in rows (a CPU
    kernel's blocks of 8 rows: docs/benchmarks-log.md section 97). The rest is never
    interpolated from plain (k = 1 pays a drafter round's fixed part) and is affine in k
    past that (k drafter steps), so a batch size's k are priced on the least-squares line
    through the k measured there, each weighing its samples, and on past the largest
    (never down); below the smallest, or with one k measured, the caller composes the
    price. A k measured `own_samples` times takes its own price.

    Prices are held at the machine's pace of when they were learned, and read at its pace
    of now (`pace`): a step whose price has settled moves the pace by `pace_weight` of how
    far it ran from its price, in the logarithm and clipped at `step_log_max` (one stalled
    second must not move it); what the pace leaves of each part moves that part's price in
    the same measure. So a k not run for a while is priced at the speed of now."""

    def __init__(self, config: SpeculationConfig | None = None):
        self.config = c = config or SpeculationConfig()
        self.weight = weight = c.step_weight
        self._plain = CostCurve(weight, extrapolate=False, median=True)
        self._drafting: dict[int, CostCurve] = {}  # the rest of a step, by k per batch size
        # a drafting step's forward, by rows, every size at the one pace (what leaves cost)
        self.forward = CostCurve(weight, median=True)
        self.pace_weight = c.pace_weight
        self.pace = 1.0
        # `_held`'s prices as plans ask for them, until a step of their curve is recorded:
        # plain's by sequences under None, a batch size's drafting rests by k under it
        self._prices: dict[int | None, dict[int, float | None]] = {}

    def _curve(self, sequences: int, k: int) -> CostCurve | None:
        return self._plain if k == 0 else self._drafting.get(sequences)

    def record(
        self, sequences: int, k: int, seconds: float, rows: int = 0, forward_s: float = 0.0
    ) -> None:
        """A steady step; a drafting one with its forward's `rows` and seconds where they
        were measured (without them the step is all rest)."""
        if sequences <= 0 or k < 0 or not seconds > 0:
            return
        self._prices.pop(None if k == 0 else sequences, None)
        forward_s = forward_s if k and rows > 0 and 0 < forward_s < seconds else 0.0
        parts = [(self._curve_for(sequences, k), sequences if k == 0 else k, seconds - forward_s)]
        if forward_s:
            parts.append((self.forward, rows, forward_s))
        held = [curve(size) if curve.samples(size) >= self._settling else None
                for curve, size, _ in parts]  # fmt: skip
        moved = 1.0
        if None not in held:  # settled: the step moves the pace
            moved = math.exp(self.pace_weight * self._off(seconds, sum(held)))
        for (curve, size, part_s), price in zip(parts, held, strict=True):
            if price is None:  # learning: at the pace of now
                curve.record(size, part_s / self.pace)
            else:  # what the pace leaves moves its price
                curve.settle(size, math.exp(self._off(part_s, price)) / moved)
        self.pace *= moved

    def _off(self, seconds: float, held: float) -> float:
        """How far `seconds` ran from a held price at the pace of now, in the logarithm
        and clipped at `step_log_max`."""
        limit = self.config.step_log_max
        return max(-limit, min(limit, math.log(seconds / (self.pace * held))))

    def _curve_for(self, sequences: int, k: int) -> CostCurve:
        """`_curve`, a batch size's first drafting one made."""
        if k and sequences not in self._drafting:
            self._drafting[sequences] = CostCurve(self.weight, extrapolate=False, median=True)
        return self._curve(sequences, k)

    def samples(self, sequences: int, k: int) -> int:
        curve = self._curve(sequences, k)
        return 0 if curve is None else curve.samples(sequences if k == 0 else k)

    def __call__(self, sequences: int, k: int, rows: float = 0.0) -> float | None:
        """A step's price; a drafting one's at the `rows` its forward feeds (its rest alone
        where no forward was measured with such steps)."""
        curve, key = (None, sequences) if k == 0 else (sequences, k)
        prices = self._prices.get(curve)
        if prices is None:
            prices = self._prices[curve] = {}
        if key not in prices:
            prices[key] = self._held(sequences, k)
        price = prices[key]
        if price is None:
            return None
        if k:
            price += self.forward(rows) or 0.0
        return self.pace * price

    def _held(self, sequences: int, k: int) -> float | None:
        if k == 0:
            return self._plain(sequences)
        curve = self._drafting.get(sequences)
        if curve is None:
            return None
        return self._own(sequences, k) or _affine(curve, k)

    def _own(self, sequences: int, k: int) -> float | None:
        """The price held for (sequences, k) once measured `own_samples` times, else None."""
        curve, size = self._curve(sequences, k), sequences if k == 0 else k
        if curve is None or curve.samples(size) < self.config.own_samples:
            return None
        return curve(size)  # a measured size: its own price (no copy of the curve)

    @property
    def _settling(self) -> float:
        """Samples after which a size's price has settled (its mean weighs each as little
        as the EMA does)."""
        return max(self.config.own_samples, 1 / self.weight)

    def measured(self) -> dict[tuple[int, int], float]:
        """Held prices at the pace of now: plain steps by (sequences, 0), the rest of
        drafting ones by (sequences, k)."""
        out = {(b, 0): s for b, s in self._plain.measured().items()}
        for b, curve in self._drafting.items():
            out.update({(b, k): s for k, s in curve.measured().items()})
        return {(b, k): self.pace * s for (b, k), s in out.items()}


class StepCostModel:
    """Seconds a decode step takes: measured for its (sequences, k) where such steps ran (a
    drafting one's forward at its rows), else composed of its parts (the forward by rows
    plus a drafter round), which leaves out what only a whole step shows: optimistic, so
    such a step runs and measures the rest."""

    def __init__(self, config: SpeculationConfig | None = None):
        self.config = c = config or SpeculationConfig()
        self.steps = StepCosts(c)  # seconds per whole decode step, by (sequences, k)
        self.forward = CostCurve(c.curve_weight)  # seconds per decode-only forward, by rows
        # seconds per drafter round, by draft steps (k), one curve per sequences in the
        # round: a round has a fixed part (the catch-up of accepted tokens, the round trip)
        # that a per-step average would charge to every step, and so undervalue long k
        self.draft: dict[int, CostCurve] = {}
        # what a switch adds to its step's steady cost: switching on, by the tokens the
        # drafter catches up on (a new prompt, or what it skipped while plain); switching
        # off, by the sequences stopping (the drafter is still drafting ahead for them)
        self.switch_on = CostCurve(c.curve_weight)
        self.switch_off = CostCurve(c.curve_weight)
        # a step whose every round an n-gram lookup drafted, less its forward, by sequences
        # (no draft model ran: what its route's share of such rounds saves, `lookup_s`)
        self.lookup = CostCurve(c.curve_weight)

    def record_forward(self, rows: int, seconds: float) -> None:
        self.forward.record(rows, seconds)

    def record_draft(self, sequences: int, steps: int, seconds: float) -> None:
        if steps > 0 and sequences > 0:
            curve = CostCurve(self.config.curve_weight, origin=True)
            self.draft.setdefault(sequences, curve).record(steps, seconds)

    def record_step(
        self,
        ks: list[int],
        seconds: float,
        catch_up: int = 0,
        stopping: int = 0,
        rows: int = 0,
        forward_s: float = 0.0,
    ) -> None:
        """A whole decode step, by the drafts that came for each of its sequences, with
        its forward's `rows` and seconds where measured; with `catch_up` tokens for the
        drafter (sequences switching on) or `stopping` sequences (switching off), what it
        took over the steady step is the switch's cost."""
        if not ks or not seconds > 0:
            return
        if catch_up or stopping:
            self._record_switch(len(ks), max(ks), seconds, catch_up, stopping, rows)
            return
        self.steps.record(len(ks), max(ks), seconds, rows, forward_s)

    def record_lookup(self, sequences: int, seconds: float, forward_s: float) -> None:
        """A steady decode step whose every round a lookup drafted: its rest, by sequences."""
        if 0 < forward_s < seconds:
            self.lookup.record(sequences, seconds - forward_s)

    def lookup_s(self, sequences: int, rows: float) -> float | None:
        """A lookup step's price: the forward by rows and the rest (None before both)."""
        forward, rest = self.forward(rows), self.lookup(sequences)
        return None if forward is None or rest is None else forward + rest

    def _record_switch(
        self, sequences: int, k: int, seconds: float, catch_up: int, stopping: int, rows: int
    ) -> None:
        steady = self.steps(sequences, k, rows)
        if steady is None or (catch_up and stopping):  # nothing to compare, or two causes
            return
        extra = max(seconds - steady, 1e-6)  # a switch adds nothing, or something
        if catch_up:
            self.switch_on.record(_power_of_two(catch_up), extra)
        else:
            self.switch_off.record(stopping, extra)

    def switch_s(self, catch_up: int, stopping: int) -> float:
        """What switching adds (0 before any such switch was measured)."""
        on = self.switch_on(_power_of_two(catch_up)) if catch_up else None
        off = self.switch_off(stopping) if stopping else None
        return (on or 0.0) + (off or 0.0)

    def __call__(self, sequences: int, k: int, rows: float, drafting: int) -> float:
        """A step of `sequences` (`drafting` of them, the most drafts `k`) feeding `rows`
        (an expected count may be a fraction)."""
        measured = self.steps(sequences, k, rows)
        if measured is not None:
            return measured
        composed = self.composed(rows, drafting, k)
        return 1.0 if composed is None else composed  # 1.0: nothing yet

    def known(self, sequences: int, k: int, rows: float) -> bool:
        """Whether a step's cost is measured or composed, not the placeholder of 1 s."""
        return self.steps(sequences, k, rows) is not None or self.forward(rows) is not None

    def composed(self, rows: float, drafting: int, k: int) -> float | None:
        """The forward by rows plus the drafter round (None before any forward; the
        forward alone before any round, which that step then measures)."""
        forward = self.forward(rows)
        if forward is None or not drafting or not self.draft:
            return forward
        # the round size measured nearest: the fewest sequences at or above, else the most
        sizes = sorted(self.draft)
        size = next((n for n in sizes if n >= drafting), sizes[-1])
        return forward + self.draft[size](k)


def _affine(curve: CostCurve, k: int) -> float | None:
    """`curve` at k by the least-squares line through its measured sizes, each weighing
    its samples, past the largest too (never down); None below the smallest or where k is
    not the one size measured."""
    points = curve.measured()
    if k not in points and (len(points) < 2 or k < min(points)):
        return None
    if len(points) < 2:
        return points[k]
    mx, my, slope = curve.line()
    return my + slope * (k - mx)


def _power_of_two(tokens: int) -> int:
    """Catch-ups run from a few tokens to whole prompts: one point of the curve per power
    of two (interpolated between, flat past the ends)."""
    return 1 << round(math.log2(tokens))
