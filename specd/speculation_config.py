"""The verifier's speculation control, every tuned number in one place (the control is
verifier_service/speculation; its flags are `specd serve verifier --help`'s, derived from
this dataclass as the others are).

What each mechanism is for, in short; how each number was measured is in
docs/benchmarks-log.md (the section named) and in git history."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SpeculationConfig:
    """How `auto` requests decide, every step, whether and how deep to draft: the k whose
    predicted tokens per second (acceptance learned per route, step costs measured online)
    beat plain decoding, with what switching costs spread over the steps it serves."""

    # -- the decision ------------------------------------------------------------------------
    # A dip in the batch (a request finished, its client's next not yet in: 0.1 s at c = 2,
    # up to ~0.4 s at c = 4 and 8 on the 2-core CPU) must not switch it to drafting, while a
    # batch that stays smaller drafts soon (docs/benchmarks-log.md section 71). A leaf
    # yields a token only where its draft is rejected: ~1.6% more a leaf on code, 5% on
    # chat (section 9).

    # the most steps a switch's cost (the drafter's catch-up, or drafting ahead for those
    # that stop) is spread over; fewer where the sequences end sooner (a count, > 0)
    horizon: int = 32
    # seconds over which the largest batch counts as the batch (a route's
    # `draft_below_batch` compares it too), so a one-step dip does not switch to drafting
    batch_memory_s: float = 0.5
    # the most an alternative tree leaf may add to a forward, as a share of its cost (0-1)
    leaf_cost: float = 0.03

    # -- acceptance --------------------------------------------------------------------------
    # Each route keeps two memories of the same rounds, both halved with wall-clock time:
    # drafting stops on a bad streak, so a route's last rounds before it goes plain are its
    # worst; the long memory holds its level through them, and after a real burst the short
    # one shows within a few probes that it ended (docs/benchmarks-log.md sections 37-38, 53,
    # 70). A route off for cost never probes: that is asked at `good_acceptance` (section 40).

    prior_acceptance: float = 0.7  # a draft's acceptance on a route before any round (0-1)
    prior_strength: float = 2.0  # rounds the prior weighs in a route's estimates
    # the acceptance (0-1) at which the control asks whether the device and batch could
    # make drafting pay at all; where they could not, a route stays off without probing
    good_acceptance: float = 0.9
    route_half_life_s: float = 30.0  # seconds in which a route's counted rounds halve
    route_short_rounds: float = 6.0  # rounds the short memory holds at most
    # rounds the long memory holds at most (also how deep a route's rounds go, as counted)
    route_long_rounds: float = 64.0
    # standard errors by which a route's acceptance must read apart to be acted on: the
    # short memory above the long one, a_1 under the route's floor (`min_acceptance`)
    route_z: float = 2.0

    # -- probing and exploring (docs/benchmarks-log.md sections 40, 46) ----------------------
    probe_every: int = 16  # steps between a k = 1 probe of a sequence off for acceptance
    # planned steps between exploring episodes, each of which runs a little-measured k
    # predicted near the best (0 = never)
    explore_every: int = 32
    explore_steps: int = 2  # steps an exploring episode runs
    # how near the best predicted rate (a share, 0-1) a k must be to be explored; the
    # window narrows as 1 / sqrt(1 + the episodes it had at that batch size)
    explore_window: float = 0.08
    # the share of each step's predicted time that episodes and probes earn to spend
    explore_share: float = 0.015
    explore_cap_s: float = 1.0  # the most seconds episodes and probes may have to spend
    # the most steps' worth (of the step planned) episodes and probes may have to spend:
    # on a device whose steps take milliseconds, a second is hundreds of steps, spent
    # probing at every start
    explore_cap_steps: int = 64

    # -- step costs (verifier_service/speculation/costs.py; log sections 44, 51-60) ----------
    curve_weight: float = 0.3  # EMA weight (0-1) of the part curves: forward, round, switch
    # EMA weight (0-1) of a whole step's price (a drafting step's cost varies with how deep
    # its round went: heavier weights flip between near-tied k)
    step_weight: float = 0.03
    own_samples: int = 8  # steps after which a k takes its own price, not the line's
    # how far (0-1) a settled step moves the machine's pace toward its own, in the
    # logarithm: prices are held at one pace and read at the pace of now
    pace_weight: float = 0.2
    step_log_max: float = 0.05  # the most one step may move the pace, in the logarithm

    def __post_init__(self):
        shares = ("prior_acceptance", "good_acceptance", "leaf_cost", "explore_window")
        for name in shares + ("step_weight",):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.probe_every <= 0 or self.horizon <= 0 or self.explore_cap_steps <= 0:
            raise ValueError("probe_every, horizon and explore_cap_steps must be positive")
