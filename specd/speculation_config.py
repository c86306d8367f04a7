"""The verifier's speculation control, every tuned number in one place (the control is
verifier_service/speculation; its flags are `specd serve verifier --help`'s, derived from
this dataclass as the others are).

What each mechanism is for, in short; how each number was measured is in
docs/benchmarks-log.md (the section named) and in git history."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SpeculationConfig:
    """How `auto` requests decide, every step, whether and how deep to draft."""

    # -- the decision ------------------------------------------------------------------------
    # a switch's cost (catch-up, or drafting ahead for those that stop) is spread over at
    # most this many steps of the run it starts
    horizon: int = 32
    # the largest batch over this many seconds counts as the batch (a route's
    # `draft_below_batch` compares it too): a dip, a request finished and its client's next
    # not yet in (0.1 s at c = 2, up to ~0.4 s at c = 4 and 8 on the 2-core CPU), must not
    # switch a batch to drafting, while a batch that stays smaller drafts soon (section 71)
    batch_memory_s: float = 0.5
    # an alternative leaf may add at most this share of a forward's cost (it yields a
    # token only where its draft is rejected: ~1.6% a leaf on code, 5% on chat; section 9)
    leaf_cost: float = 0.03

    # -- acceptance --------------------------------------------------------------------------
    prior_acceptance: float = 0.7  # a_i on a route before any round
    # rounds the prior weighs, in a route's acceptance and in how deep its rounds go
    prior_strength: float = 2.0
    # whether the device and batch could make drafting pay at all is asked at this
    # acceptance, not at the prior: a route off for cost never probes (section 40)
    good_acceptance: float = 0.9
    # a route's two memories of the same rounds, both halved every `route_half_life_s`:
    # a short one (`route_short_rounds`) that shows within a few probes that a burst
    # ended, and a long one (`route_long_rounds`) that holds the route's level through a
    # bad streak; the estimate is the long one's unless the short one is higher by
    # `route_z` standard errors. Positions a round could not reach that read under the one
    # before fade by `route_fade` a round toward it (sections 37-38, 70). How deep a
    # route's rounds go (the drafter stops after an unsure draft) is kept over
    # `route_long_rounds` (section 53)
    route_half_life_s: float = 30.0
    route_short_rounds: float = 6.0
    route_long_rounds: float = 64.0
    route_z: float = 2.0
    route_fade: float = 0.9

    # -- probing and exploring ---------------------------------------------------------------
    probe_every: int = 16  # a sequence off for acceptance drafts one k = 1 round this often
    # one exploring episode of `explore_steps` steps in `explore_every` planned steps (0:
    # never) runs the least measured k predicted within `explore_window` of the best,
    # the window narrowing as 1 / sqrt(1 + its episodes at that batch size) (section 46)
    explore_every: int = 32
    explore_steps: int = 2
    explore_window: float = 0.08
    # episodes and probes together may spend this share of the predicted step time: the
    # budget grows by it every step, up to `explore_cap_s` (section 40)
    explore_share: float = 0.015
    explore_cap_s: float = 1.0

    # -- step costs (verifier_service/speculation/costs.py) ---------------------------------
    curve_weight: float = 0.3  # EMA weight of the part curves (forward, drafter round, switch)
    # EMA weight of a whole step's price: a drafting step's cost varies with how deep its
    # round went, and heavier weights flipped `auto` between near-tied k (section 44)
    step_weight: float = 0.03
    # steps after which a k takes its own price, not the line's through the k measured
    own_samples: int = 8
    # the machine's pace against the held prices: a settled k's step moves it by
    # `pace_weight` of its distance from its price (in the logarithm, clipped at
    # `step_log_max`; sections 51-60)
    pace_weight: float = 0.2
    step_log_max: float = 0.05

    def __post_init__(self):
        shares = ("prior_acceptance", "good_acceptance", "leaf_cost")
        for name in shares + ("route_fade", "explore_window", "step_weight"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.probe_every <= 0 or self.horizon <= 0:
            raise ValueError("probe_every and horizon must be positive")
