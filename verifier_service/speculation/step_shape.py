"""What the controller prices a planned step by: the decoding sequences it may change
(`Candidate`) beside the rest of the batch (`Fixed`), how deep each round is expected to go
(`reach`, `deepest`), and the step's shape for verifier_service/speculation/costs.py: (sequences,
P(its deepest round drafts at least j tokens) by j, the expected rows fed, the sequences
drafting, P(every round is a lookup)). Pure Python, like the controller
(verifier_service/speculation/controller.py)."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from functools import lru_cache

from verifier_service.speculation.acceptance import expected_table, expected_tokens


@dataclass
class Candidate:
    """One decoding sequence of an `auto` request, as the controller sees it."""

    cap: int  # the most drafts the route and the sequence allow this step
    accept: list[float]  # a_i by position
    probe: bool = False  # due a probe round if it is off for acceptance
    floor: float = 0.0  # the route's min_acceptance: a route known under it is off for acceptance
    behind: int = 0  # tokens the drafter catches up on first (0: it drafted last step)
    remaining: int = 0  # tokens the request may still generate (0: unknown)
    # c_i: the chance that its drafter, having drafted i + 1 tokens, drafts another (its
    # route's; [] = it always drafts all k). The drafter stops a round after an unsure
    # draft (`--draft-p-min`), so how deep a round planned at k goes depends on the route
    goes_on: list[float] = field(default_factory=list)
    # P(its round is an n-gram lookup, no draft model run: its route's share of rounds)
    lookup: float = 0.0
    # a_1's upper bound over the rounds measured (RouteAcceptance.upper), held against the
    # floor; None: a_1 itself
    upper: float | None = None

    def __post_init__(self):
        # by k up to `cap`: E(k) (`expected_tokens`), P(a round planned at k drafts at
        # least j tokens) for j = 1..cap (`reach`; a round at k reaches the first k), and
        # the drafts a round planned at k is expected to feed the forward. A plan reads
        # them at every k of every arm it prices, and the sequences of a route share them
        goes_on = tuple(self.goes_on)
        self.expected, self.reached, self.fed = _route_tables(tuple(self.accept), goes_on, self.cap)
        # what its arms' steps depend on
        self.step_key = (self.cap, goes_on, self.behind, self.lookup)

    @property
    def under_floor(self) -> bool:
        """Known to accept under its route's floor: off for acceptance, probing only."""
        return (self.accept[0] if self.upper is None else self.upper) < self.floor

    def at(self, accept: float) -> Candidate:
        """The same sequence at an acceptance of `accept` at every position (built
        directly: `dataclasses.replace` costs a plan at a large batch a tenth of its time)."""
        return Candidate(
            self.cap, [accept], self.probe, self.floor, self.behind, self.remaining,
            self.goes_on, self.lookup, self.upper,
        )  # fmt: skip


@lru_cache(maxsize=256)
def _route_tables(
    accept: tuple[float, ...], goes_on: tuple[float, ...], cap: int
) -> tuple[list[float], list[float], list[float]]:
    """A candidate's E(k), reach and drafts fed by k (`Candidate`); read-only."""
    reached = reach(list(goes_on), cap)
    fed = list(itertools.accumulate(reached, initial=0.0))
    return expected_table(list(accept), cap), reached, fed


@dataclass(frozen=True)
class Fixed:
    """The rest of the step's decoding sequences (plain, forced or bounded k), which the
    plan does not change."""

    sequences: int = 0
    rows: float = 0  # expected (drafts come short where a drafter stops early)
    tokens: float = 0.0
    k: int = 0  # the most drafts of any of them
    # P(the deepest of their rounds drafts at least j tokens), j = 1..k (`deepest`);
    # () = all k come
    reach: tuple[float, ...] = ()

    @classmethod
    def of(cls, rounds: list[tuple[list[float], list[float], int]]) -> Fixed:
        """The rest from each of its sequences' (a_i, c_i, k)."""
        reaches = [reach(goes_on, k) for _, goes_on, k in rounds]
        rows = sum(1 + sum(r) for r in reaches)
        tokens = sum(expected_tokens(accept, k) for accept, _, k in rounds)
        most = max((k for _, _, k in rounds), default=0)
        return cls(len(rounds), rows, tokens, most, tuple(deepest(reaches)))


def reach(goes_on: list[float], k: int) -> list[float]:
    """P(a round planned at k drafts at least j tokens), j = 1..k: the first always comes,
    each next one with its chance c_i (the last measured repeats; [] = always)."""
    out, p = [], 1.0
    for j in range(k):
        if j and goes_on:
            p *= goes_on[min(j - 1, len(goes_on) - 1)]
        out.append(p)
    return out


def step_shape(
    candidates: list[Candidate], ks: list[int], fixed: Fixed
) -> tuple[int, list[float], float, int, float]:
    """A planned step as the cost model prices it: (sequences, P(its deepest round drafts
    at least j tokens) by j, the expected rows fed, the sequences drafting, P(every round
    is a lookup: `all_lookups`)). Steps are
    measured by the drafts that came (costs.py), and a round planned at k comes short
    where the drafter stops early, more often on some routes than on others (chat's more
    than code's: docs/benchmarks-log.md section 53). The deepest round of independent ones:
    P(deepest >= j) = 1 - prod_s (1 - P(d_s >= j)); the rest of the batch (`fixed`)
    drafts its k."""
    rows, drafting = float(fixed.rows), 1 if fixed.k else 0
    reaches = [list(fixed.reach) or [1.0] * fixed.k]
    for c, k in zip(candidates, ks, strict=True):
        rows += 1 + c.fed[k]
        drafting += 1 if k else 0
        reaches.append(c.reached[:k])
    drafters = [c for c, k in zip(candidates, ks, strict=True) if k]
    lookups = all_lookups(drafters, fixed)
    return fixed.sequences + len(ks), deepest(reaches), rows, drafting, lookups


def all_lookups(drafters: list[Candidate], fixed: Fixed) -> float:
    """P(every round of a step is an n-gram lookup, so that no draft model runs), its
    drafting candidates' rounds independent; 0 where nothing drafts or the rest of the
    batch drafts (its route's share is not the plan's)."""
    if not drafters or fixed.k:
        return 0.0
    return math.prod(c.lookup for c in drafters)


def arm_shapes(
    candidates: list[Candidate], fixed: Fixed
) -> list[tuple[int, list[float], float, int, float]]:
    """`step_shape` of every arm at once: each candidate at min(k, its cap), k = 0..the
    largest cap. A candidate's reach at min(k, cap) is its whole reach below k, so the
    deepest round's P(>= j) for j < k is the same at every arm: the product over the
    candidates is taken once (in `deepest`'s order, so each arm's shape is the same)."""
    top = max((c.cap for c in candidates), default=0)
    rest = [1 - p for p in list(fixed.reach) or [1.0] * fixed.k]  # P(none of the rest >= j)
    miss = rest + [1.0] * (top - len(rest))  # then P(no round >= j), each at its cap
    for c in candidates:
        for j, p in enumerate(c.reached):
            miss[j] *= 1 - p
    shapes, fed = [], [(c.fed, c.cap) for c in candidates]
    plain = (1 if fixed.k else 0), 0.0  # sequences drafting, P(all lookups) at k = 0
    drafters = [c for c in candidates if c.cap]  # at every k > 0
    drafting = plain[0] + len(drafters), all_lookups(drafters, fixed)
    sequences = fixed.sequences + len(candidates)
    for k in range(top + 1):
        rows = float(fixed.rows)
        for by_k, cap in fed:
            rows += 1 + by_k[min(k, cap)]
        reach_max = [1 - m for m in miss[:k]] + [1 - m for m in rest[k:]]
        shapes.append((sequences, reach_max, rows, *(drafting if k else plain)))
    return shapes


def deepest(reaches: list[list[float]]) -> list[float]:
    """Independent rounds, each P(d >= j) by j (`reach`) -> the deepest one's:
    P(max d >= j) = 1 - prod_s (1 - P(d_s >= j)); its sum is the expected deepest."""
    out = []
    for j in range(max((len(r) for r in reaches), default=0)):
        miss = 1.0
        for r in reaches:
            miss *= 1 - (r[j] if j < len(r) else 0.0)
        out.append(1 - miss)
    return out
