"""One request's state inside the engine, and what a step hands back for it."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from specd.grammar import GrammarState
from specd.params import SamplingParams
from verifier_service.controller import PositionAcceptance


@dataclass
class SpecStats:
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    reason: str = ""  # set when the request finishes (SpeculationBounds.reason)

    def record(self, k: int, a: int) -> None:
        if k == 0:
            return
        self.rounds += 1
        self.drafted += k
        self.accepted += a

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per speculation round (accepted + the recovered/bonus one)."""
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0


@dataclass(frozen=True)
class SpeculationBounds:
    """What the request's route allows. `auto`: the controller picks k <= num_draft per
    step within these bounds; otherwise every step drafts num_draft (0: never)."""

    auto: bool = False
    route: str = "default"
    draft_below_batch: int = 0  # > 0: no drafts while this many sequences run
    max_kv_utilization: float = 1.0  # no drafts while the KV pool is fuller than this
    min_acceptance: float = 0.0  # below this, off for acceptance (probing only)

    def validate(self) -> None:
        if self.draft_below_batch < 0:
            raise ValueError("draft_below_batch must be >= 0")
        for name in ("max_kv_utilization", "min_acceptance"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:  # also refuses NaN
                raise ValueError(f"{name} must be in [0, 1], got {value}")

    @staticmethod
    def reason(decisions: Counter, rounds: int) -> str:
        """One reason for the whole request, consistent with its counts: "on" when rounds
        ran that were not only probes; "probe" when only probes ran; with no rounds, the
        most frequent reason of its steps ("off:drafter-unavailable" when every step
        chose to draft and no drafter answered; "off:request" when it never could)."""
        if rounds:
            return "on" if decisions.get("on") else "probe"
        offs = Counter({r: n for r, n in decisions.items() if r not in ("on", "probe")})
        if offs:
            return offs.most_common(1)[0][0]
        return "off:drafter-unavailable" if decisions else "off:request"


@dataclass
class Sequence:
    seq_id: int
    prompt: list[int]
    params: SamplingParams
    max_new_tokens: int
    num_draft: int  # k asked for (0: no speculation)
    stop_ids: frozenset[int]
    generator: torch.Generator
    tokens: list[int] = field(default_factory=list)  # prompt + generated (committed)
    num_cached: int = 0  # tokens whose K/V the target cache holds
    finish_reason: str | None = None
    stats: SpecStats = field(default_factory=SpecStats)
    span: object = None  # the request's trace span (None when tracing is off)
    positions: PositionAcceptance = field(default_factory=PositionAcceptance)
    t_arrived: int = field(default_factory=time.time_ns)
    t_scheduled: int = 0  # first prefill chunk
    t_first_token: int = 0
    speculation: SpeculationBounds = field(default_factory=lambda: SpeculationBounds())
    decisions: Counter = field(default_factory=Counter)  # reason -> decode steps
    off_steps: int = 0  # decode steps since the last round that drafted (for probes)
    step_decision: tuple[str, float] = ("", 1.0)  # this step: reason, predicted gain
    grammar: GrammarState | None = None  # a constrained request's state at `tokens`

    def __post_init__(self):
        if not self.tokens:
            self.tokens = list(self.prompt)

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - len(self.prompt)

    @property
    def prefilling(self) -> bool:
        """True until the first token exists (the pending token is then never cached)."""
        return self.num_generated == 0


@dataclass
class StepOutput:
    seq_id: int
    tokens: list[int]  # newly committed this step (after stop checks)
    finish_reason: str | None  # "stop", "length", "abort" or None while running
    drafted: int = 0
    accepted: int = 0
    stats: SpecStats | None = None  # the request's speculation totals, on its last output
    timing: tuple[int, int, int] = (0, 0, 0)  # last output: arrived, scheduled, first token (ns)
    decision: tuple[str, float] = ("", 1.0)  # the controller's reason and predicted gain
