"""What steps cost, measured online, for the speculation controller
(verifier_service/controller.py): whole decode steps by (sequences, k), the parts a
step is composed of where no such step was measured yet (a forward by rows, a drafter
round by sequences and steps), and what switching between drafting and plain adds."""

from __future__ import annotations

import math
import statistics
from bisect import bisect_left

_FIT_CAP = 16  # the most samples one k weighs in a drafting-step line (StepCosts)
_OWN = 8  # samples after which a k takes its own measured price, not the line's
_PACE_MAX = 4.0  # the machine's pace against the prices held stays within 1/4 .. 4
# how far from its price a settled step counts, in the logarithm (StepCosts.record)
_STEP_LOG_MAX = 0.05


class CostCurve:
    """Seconds per event by size (rows of a forward, sequences in a drafter round, drafts
    of a step), an EMA per size (from its second event) with its sample count. Unmeasured
    sizes interpolate between measured neighbours. Below the smallest measured size the
    curve is flat; past the largest it goes on along the line from the smallest size to the
    largest, never down: flat on a memory-bound device, where rows cost nearly nothing, and
    what rows do cost on a CPU, where a flat guess (a 28-row verification priced as the
    4-row forward measured) made a fresh verifier draft at batch 4 until it had paid for
    such steps. The whole span, not the last two sizes: two neighbours (15 and 16 rows)
    differ by less than their noise, and where the larger came out cheaper the curve went
    on flat, so that batch 4, with k = 3 measured at 168 ms, priced k = 6 at 166 (it took
    ~295: BENCHMARKS.md section 54). With one size measured the curve is flat past it, or
    with `origin` goes on through zero: a drafter round of k steps is k forwards. With
    `extrapolate=False` the curve is unknown (None) outside the measured sizes. With
    `median`, a size's price is the median of its events since the second until its EMA
    would weigh each as little as `weight` (the whole steps' prices, `StepCosts`)."""

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
        elif count == 1:
            # the first event of a size may run cold (a fresh verifier's first drafting
            # forward: 0.16 s, later ones 0.08-0.10), and an EMA would keep it for ~20
            # events: the second replaces it, an EMA from the third
            self._by_size[size] = seconds
            if self.median:
                self._learning[size] = [seconds]
        elif self.median and count < 1 / self.weight:
            # A stall while a price is learned must not set it: two steps of 347 and 525
            # ms among ~100 at batch 2, k = 3 made their mean 138 ms, which a settled
            # price then kept for hundreds of steps (StepCosts.record moves it by ~0.1% a
            # step), so k = 3 was priced ~20% dearer against k = 6 than it ran. The
            # median is also where a settled price goes (as many steps over as under).
            learning = self._learning[size]
            learning.append(seconds)
            self._by_size[size] = statistics.median(learning)
            if count + 1 >= 1 / self.weight:
                del self._learning[size]
        else:
            # the mean of the samples since the second, until that weighs each less than
            # the EMA does (a small weight then costs no slow start)
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


class StepCosts:
    """Seconds per whole decode step by (sequences in the step, most drafts that came for
    any of them), as the engine ran it: drafter round, forward with its tree leaves,
    verification, commit. The controller compares these directly, rather than adding up
    parts: the parts missed the tree leaves a small batch verifies beside its chain (a
    2-draft step fed 4.5 rows, not 3) and the drafter's catch-up and round trip
    (BENCHMARKS.md section 19).

    Plain steps are one curve by sequences; drafting steps one curve by k per batch size,
    never interpolated from plain: k = 1 pays a drafter round's fixed part (the round
    trip, the tree leaves), far more than halfway to k = 2. Past k = 1 a step's cost is
    affine in k (k drafter steps, k more rows), so between the k measured for a batch size
    the curve is the least-squares line through them, weighted by their samples: a k
    measured a few times, early and dear (before the forward priced its tree leaves) or in
    a noisy second, would otherwise keep a price its neighbours contradict, and as the
    controller stays off a k that looks dear, nothing would correct it. Past the largest
    k measured the line goes on (never down): the composed guess priced batch 4 drafting
    5 at 0.24 s a step, and it took 0.76-0.82 s. Below the smallest, or with one k
    measured, the cost is unknown (None) and the caller falls back. The line is for the k
    run seldom: a k measured `_OWN` times takes its own median. Steps are not affine in k
    everywhere. k = 1's fixed part lies above the line (priced 57-61 ms, it took 67-77,
    and `auto` chose it where it made less than plain: BENCHMARKS.md section 31). On an
    AVX2 CPU, whose kernel runs rows in blocks, k = 3 took 99 ms and k = 4 and 5 took 128
    and 153, where the line through k = 1-6 put them at 102, 124 and 146 (section 40)."""

    # A drafting step's cost varies from step to step: its drafter stops the round
    # where it is unsure (p_min), so a step planned at k = 6 drafts anywhere from 1 to 6.
    # At an EMA weight of 0.1 that noise flipped `auto` between near-tied k (code at c = 1
    # ran k = 3-6 where k = 6 was best); at 0.03 the replay gave 0.986 of the best fixed
    # k instead of 0.979, chat 0.998 instead of 0.994, and as well where the machine's
    # speed wanders (BENCHMARKS.md section 44)
    def __init__(self, weight: float = 0.03, pace_weight: float = 0.2):
        self.weight = weight
        self._plain = CostCurve(weight, extrapolate=False, median=True)
        self._drafting: dict[int, CostCurve] = {}
        # How slow the machine runs now against the prices held (1.0: as they were
        # learned). The curves hold prices at the pace of their time; a step is priced at
        # the pace of now. Without it, only the k being run followed the machine, and the
        # others kept the speed of when they last ran: at batch 4, plain steps went from
        # 42 to 53 ms as the host slowed, k = 1 kept the 82 ms of a fast minute, and
        # `auto` drafted at k = 1 for ~70 steps, at 88 tok/s where plain made 94.
        # A running k's drift cannot be told from the machine's, so a k whose price has
        # settled (measured 1 / weight times, where its EMA's weight reaches `weight`, and
        # at least `_OWN`) moves the pace by how far its step ran from its price, and what
        # corrects its price against another k is running the other (as exploring does,
        # and as the depths of one plan do where its drafter stops short); a k measured
        # fewer times learns its price (the median of its steps), whole. Moved from the
        # 9th step on, the first few fixed k = 1's price against plain at 1.81-1.87 where
        # its steps ran 1.98.
        self.pace_weight = pace_weight
        self.pace = 1.0

    def _curve(self, sequences: int, k: int) -> CostCurve | None:
        return self._plain if k == 0 else self._drafting.get(sequences)

    def record(self, sequences: int, k: int, seconds: float) -> None:
        if sequences <= 0 or k < 0 or not seconds > 0:
            return
        held = self._settled(sequences, k)
        if held is not None:
            # The step's distance from its price, in the logarithm and clipped: a k learned
            # while no settled k runs is learned at the pace of then, and what moves the
            # pace must be the machine, not one stalled second. Unclipped, six batch-2
            # steps at 1.2-2.1x their price (the forward stalled at a cell's end) moved it
            # from 0.98 to 1.26; k = 6, learned next, held a price 26% under its steps,
            # and `auto` ran k = 6 at c = 2 where k = 3 made ~15% more (BENCHMARKS.md
            # section 60). Clipped at 0.05, a step moves the pace by 1% at most: those six
            # moved it to 1.07, and a host that slows by a quarter is followed in ~25 steps.
            off = max(-_STEP_LOG_MAX, min(_STEP_LOG_MAX, math.log(seconds / (self.pace * held))))
            before = self.pace
            self.pace = min(
                _PACE_MAX, max(1 / _PACE_MAX, before * math.exp(self.pace_weight * off))
            )
            # What the pace left of the step moves its price, in the same measure, so that
            # both settle where as many steps run over as under (by their clipped
            # distances). Measured apart (the pace in the logarithm, the price as an EMA
            # in seconds, which settles ~σ²/2 higher), the two pulled apart for as long as
            # one k ran, the pace down and the price up: batch 2 at k = 3 (a log spread of
            # 0.18) moved the pace from 1.04 to 0.88 in 40 s, which priced k = 4 and 6,
            # held from before, 12-14% under their steps (section 59).
            self._curve(sequences, k).settle(
                sequences if k == 0 else k, math.exp(off) * before / self.pace
            )
            return
        seconds /= self.pace
        if k == 0:
            self._plain.record(sequences, seconds)
        else:
            self._drafting.setdefault(
                sequences, CostCurve(self.weight, extrapolate=False, median=True)
            )
            self._drafting[sequences].record(k, seconds)

    def samples(self, sequences: int, k: int) -> int:
        curve = self._curve(sequences, k)
        return 0 if curve is None else curve.samples(sequences if k == 0 else k)

    def __call__(self, sequences: int, k: int) -> float | None:
        price = self._held(sequences, k)
        return None if price is None else self.pace * price

    def _held(self, sequences: int, k: int) -> float | None:
        if k == 0:
            return self._plain(sequences)
        curve = self._drafting.get(sequences)
        if curve is None:
            return None
        return self._own(sequences, k) or _affine(curve, k)

    def _own(self, sequences: int, k: int, samples: float = _OWN) -> float | None:
        """The price held for (sequences, k) once measured `samples` times, else None."""
        curve, size = self._curve(sequences, k), sequences if k == 0 else k
        if curve is None or curve.samples(size) < samples:
            return None
        return curve(size)  # a measured size: its own price (no copy of the curve)

    def _settled(self, sequences: int, k: int) -> float | None:
        return self._own(sequences, k, max(_OWN, 1 / self.weight))

    def measured(self) -> dict[tuple[int, int], float]:
        out = {(b, 0): s for b, s in self._plain.measured().items()}
        for b, curve in self._drafting.items():
            out.update({(b, k): s for k, s in curve.measured().items()})
        return {key: self.pace * s for key, s in out.items()}


class StepCostModel:
    """Seconds a decode step takes: measured for its (sequences, k) where such steps ran,
    else composed (the forward by rows plus a drafter round) and scaled by how the measured
    steps compared with their composed estimates."""

    def __init__(self):
        self.steps = StepCosts()  # seconds per whole decode step, by (sequences, k)
        self.forward = CostCurve()  # seconds per decode-only forward, by rows
        # seconds per drafter round, by draft steps (k), one curve per sequences in the
        # round: a round has a fixed part (the catch-up of accepted tokens, the round trip)
        # that a per-step average would charge to every step, and so undervalue long k
        self.draft: dict[int, CostCurve] = {}
        self.calibration = 1.0  # measured steps / their composed estimates (an EMA)
        # what a switch adds to its step's steady cost: switching on, by the tokens the
        # drafter catches up on (a new prompt, or what it skipped while plain); switching
        # off, by the sequences stopping (the drafter is still drafting ahead for them)
        self.switch_on = CostCurve()
        self.switch_off = CostCurve()

    def record_forward(self, rows: int, seconds: float) -> None:
        self.forward.record(rows, seconds)

    def record_draft(self, sequences: int, steps: int, seconds: float) -> None:
        if steps > 0 and sequences > 0:
            self.draft.setdefault(sequences, CostCurve(origin=True)).record(steps, seconds)

    def record_step(
        self, ks: list[int], seconds: float, catch_up: int = 0, stopping: int = 0
    ) -> None:
        """A whole decode step, by the drafts that came for each of its sequences; with
        `catch_up` tokens for the drafter (sequences switching on) or `stopping` sequences
        (switching off), what it took over the steady step is the switch's cost."""
        if not ks or not seconds > 0:
            return
        if catch_up or stopping:
            self._record_switch(len(ks), max(ks), seconds, catch_up, stopping)
            return
        drafting = [k for k in ks if k]
        composed = self.composed(sum(1 + k for k in ks), len(drafting), max(ks))
        self.steps.record(len(ks), max(ks), seconds)
        if composed is not None:
            self.calibration += 0.1 * (seconds / composed - self.calibration)

    def _record_switch(
        self, sequences: int, k: int, seconds: float, catch_up: int, stopping: int
    ) -> None:
        steady = self.steps(sequences, k)
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
        measured = self.steps(sequences, k)
        if measured is not None:
            return measured
        composed = self.composed(rows, drafting, k)
        return 1.0 if composed is None else self.calibration * composed  # 1.0: nothing yet

    def known(self, sequences: int, k: int, rows: float) -> bool:
        """Whether a step's cost is measured or composed, not the placeholder of 1 s."""
        return self.steps(sequences, k) is not None or self.forward(rows) is not None

    def composed(self, rows: float, drafting: int, k: int) -> float | None:
        """The forward by rows plus the drafter round (None before any forward)."""
        forward = self.forward(rows)
        if forward is None or not drafting:
            return forward
        if not self.draft:
            return forward * (1 + 0.25 * k)  # before any round: a draft step guessed at 1/4
        # the round size measured nearest: the fewest sequences at or above, else the most
        sizes = sorted(self.draft)
        size = next((n for n in sizes if n >= drafting), sizes[-1])
        return forward + self.draft[size](k)


def _affine(curve: CostCurve, k: int) -> float | None:
    """`curve` at k by the weighted least-squares line through its measured sizes (each
    weighs its samples, at most `_FIT_CAP`, so one k the controller ran for minutes does
    not drown the rest), past the largest too; None below the smallest or where k is not
    the one size measured."""
    points = curve.measured()
    if k not in points and (len(points) < 2 or k < min(points)):
        return None
    if len(points) < 2:
        return points[k]
    w = {x: min(curve.samples(x), _FIT_CAP) for x in points}
    total = sum(w.values())
    mx = sum(w[x] * x for x in points) / total
    my = sum(w[x] * y for x, y in points.items()) / total
    var = sum(w[x] * (x - mx) ** 2 for x in points)
    slope = max(0.0, sum(w[x] * (x - mx) * (y - my) for x, y in points.items()) / var)
    return my + slope * (k - mx)


def _power_of_two(tokens: int) -> int:
    """Catch-ups run from a few tokens to whole prompts: one point of the curve per power
    of two (interpolated between, flat past the ends)."""
    return 1 << round(math.log2(tokens))
