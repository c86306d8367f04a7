"""What one step hands from phase to phase: the view of its decoding sequences the
speculation control plans from (`StepView`), its plan (`StepPlan`: a `Decision` each),
the scheduler's `Slot`, the drafting phase's `Round`, and the report the control learns
from (`StepReport`). They live below the phases, so that each phase imports what it is
handed and nothing of the phases before it (verification needs no scheduler, the
scheduler no speculation control)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from specd.models.seq_input import SeqInput
from specd.proposal import Proposal
from verifier_service.request import SpeculationBounds
from verifier_service.sequence import Sequence
from verifier_service.tree import tree_parents


class Decision(NamedTuple):
    k: int  # drafts allowed this step
    reason: str  # "on", "probe", "off:batch", "off:kv", "off:request", "off:cost", ...
    gain: float  # the controller's predicted speed-up (1.0 when it did not plan)


PREFILL = Decision(0, "", 1.0)  # a prefill chunk decides no speculation


@dataclass(frozen=True)
class Slot:
    """One sequence's part of a step."""

    seq: Sequence
    tokens: tuple[int, ...]  # fed this step: the pending token (decode) or a prefill chunk
    decode: bool
    k: int = 0  # decode: the most drafts (the drafter may return fewer)
    alts: int = 0  # decode: the most alternative leaves beside them (KV reserved)
    logits: bool = True  # a prefill chunk: True only for the last chunk of a fresh prompt
    decision: Decision = PREFILL
    # a prefill chunk: a row of logits for each of its tokens, for the prompt's
    # log-probabilities (SamplingParams.prompt_logprobs), beside the one that samples
    prompt_rows: bool = False

    @property
    def seq_id(self) -> int:
        return self.seq.seq_id


@dataclass(frozen=True)
class Round:
    """One sequence's part of the forward: its slot and the drafts verified with it."""

    slot: Slot
    proposal: Proposal | None = None  # None: prefill, plain decode, or no drafts came
    mask: torch.Tensor | None = None  # constrained: bool [nodes, V], the allowed tokens

    @property
    def seq(self) -> Sequence:
        return self.slot.seq

    @property
    def k(self) -> int:
        """Drafts verified this round."""
        return len(self.proposal.tokens) if self.proposal is not None else 0

    @property
    def lookup(self) -> bool:
        """Its drafts were a lookup (Proposal.ngram): no draft model ran for them."""
        return self.proposal is not None and self.proposal.ngram

    @property
    def predicted(self) -> bool:
        """Its drafts were the client's predicted output's (Proposal.predicted)."""
        return self.proposal is not None and self.proposal.predicted

    @property
    def num_logits(self) -> int:
        """Rows of logits it needs: every node of a decode round (root, chain,
        alternatives); one for the last chunk of a fresh prompt; one a token for a chunk
        whose prompt log-probabilities are read (`prompt_rows`); else none."""
        if not self.slot.decode:
            return len(self.slot.tokens) if self.slot.prompt_rows else int(self.slot.logits)
        p = self.proposal
        return 1 + (len(p.tokens) + len(p.alts) if p is not None else 0)

    def seq_input(self) -> SeqInput:
        fed, p = list(self.slot.tokens), self.proposal
        if p is None:
            return SeqInput(self.slot.seq_id, fed, self.num_logits)
        alts = [t for _, t in p.alts]
        parents = tree_parents(len(fed), p) if alts else None
        return SeqInput(self.slot.seq_id, fed + p.tokens + alts, self.num_logits, parents)


@dataclass(frozen=True)
class SeqView:
    """One decoding sequence as the plan sees it."""

    seq_id: int
    bounds: SpeculationBounds  # the route's bounds the router sent
    key: str  # whose acceptance its next round drafts at (Sequence.acceptance_key)
    asked: int  # the most drafts its next round may take (Sequence.draft_cap; 0: none)
    remaining: int  # tokens it may still generate
    off_steps: int  # decode steps since its last drafting round
    behind: int  # tokens the drafter catches up on before it can draft for it

    @classmethod
    def of(cls, seq) -> SeqView:
        """The view of a verifier_service.sequence.Sequence."""
        remaining = seq.max_new_tokens - seq.num_generated
        return cls(
            seq.seq_id, seq.speculation, seq.acceptance_key, seq.draft_cap, remaining,
            seq.off_steps, seq.drafter_behind,
        )  # fmt: skip

    def after(self, k: int) -> SeqView:
        """This view one decode step on, the step having run k drafts, as planned ahead
        (SpeculationControl.plan_ahead): a token fewer left (at least one comes), and the
        steps off and the drafter's lag as `Sequence.decided` and `.drafter_behind` move
        them: a drafting round catches the drafter up, a plain step puts it one more
        behind (two after a round: the token decoded and the one it will feed)."""
        if k:
            return replace(self, remaining=self.remaining - 1, off_steps=0, behind=0)
        behind = self.behind + 1 if self.behind else 2
        return replace(
            self, remaining=self.remaining - 1, off_steps=self.off_steps + 1, behind=behind
        )


@dataclass(frozen=True)
class StepView:
    ready: tuple[SeqView, ...]  # the sequences that decode this step, in batch order
    batch: int  # sequences running and waiting
    kv_used: float  # the KV pool's utilization


@dataclass(frozen=True)
class StepPlan:
    decisions: tuple[Decision, ...]  # per ready sequence, in its order
    leaves: int  # alternative leaves the step may verify beside the chains
    # (tokens, seconds) the controller expects of the step, its leaves left out (None where
    # it did not price the step: no `auto` sequence, a probe, no cost model)
    expected: tuple[float, float] | None = None


@dataclass(frozen=True)
class RoundReport:
    """One sequence's part of a step, as it ran."""

    seq_id: int
    route: str  # whose acceptance it is (SpeculationBounds.acceptance_key)
    decode: bool  # a decode round (else a prefill chunk)
    planned: int  # drafts the plan allowed (decode)
    drafted: int  # drafts that came and were verified
    accepted: int | None  # of those, accepted; None: a prefill chunk before the last
    proposed: bool  # a proposal came (even one cut to nothing)
    ngram: bool  # its drafts were an n-gram lookup (no draft model ran)
    rows: int  # rows of logits it fed
    behind: int  # tokens the drafter caught up on first (as the step began)


@dataclass(frozen=True)
class StepReport:
    rounds: tuple[RoundReport, ...] = ()
    draft_s: float = 0.0  # the drafter's round
    forward_s: float = 0.0  # the forward
    step_s: float = 0.0  # the whole step, commit included


@dataclass(frozen=True)
class Observed:
    """What the control has learned, as the load reports show it."""

    acceptance_by_route: dict[str, float]
    pace: float  # how slow steps run against the prices held (1.0: as they were learned)
