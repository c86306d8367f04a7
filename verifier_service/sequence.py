"""One request's state inside the engine, and what a step hands back for it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specd.sampling import SamplingParams
from verifier_service.adaptive import AcceptanceEstimate


@dataclass
class SpecStats:
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    stats: SpecStats | None = None  # the request's speculation totals, on its last output
    timing: tuple[int, int, int] = (0, 0, 0)  # last output: arrived, scheduled, first token (ns)
    drafted_per_pos: list[int] = field(default_factory=list)
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, k: int, a: int) -> None:
        if k == 0:
            return
        self.rounds += 1
        self.drafted += k
        self.accepted += a
        grow = k - len(self.drafted_per_pos)
        if grow > 0:
            self.drafted_per_pos += [0] * grow
            self.accepted_per_pos += [0] * grow
        for j in range(k):
            self.drafted_per_pos[j] += 1
            self.accepted_per_pos[j] += j < a

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per speculation round (accepted + the recovered/bonus one)."""
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0


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
    acceptance: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)
    t_arrived: int = field(default_factory=time.time_ns)
    t_scheduled: int = 0  # first prefill chunk
    t_first_token: int = 0
    draft_below_batch: int = 0  # > 0: draft only while fewer sequences than this run

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
