"""What a client asks the engine for: one typed request, checked once before it queues."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from specd.config import check_proposer
from specd.constraint import Constraint
from specd.context_limit import ContextExceeded
from specd.params import SamplingParams


@dataclass(frozen=True)
class SpeculationBounds:
    """What the request's route allows. `auto`: the controller picks k <= num_draft per
    step within these bounds; otherwise every step drafts num_draft (0: never)."""

    auto: bool = False
    route: str = "default"
    draft_below_batch: int = 0  # > 0: no bounded sequence drafts while this many run
    max_kv_utilization: float = 1.0  # no drafts while the KV pool is fuller than this
    min_acceptance: float = 0.0  # known to accept under this: off for acceptance (probing)
    proposer: str = ""  # how the drafter drafts for the route ("": the drafter's own)
    suffix_private: bool = False  # a suffix drafter shares nothing of this request

    def acceptance_key(self, predicted: bool = False) -> str:
        """Under which name the speculation control learns the acceptance of this
        request's rounds: a predicted output's drafts (Request.prediction) apart from the
        route's drafter's."""
        return f"{self.route}+prediction" if predicted else self.route

    def validate(self) -> None:
        if self.draft_below_batch < 0:
            raise ValueError("draft_below_batch must be >= 0")
        check_proposer(self.proposer)
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


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    max_new_tokens: int = 64
    # the most drafts per round; with speculation.auto the controller picks k <= num_draft
    # every step, else every round drafts num_draft
    num_draft: int = 0
    stop_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False  # else the model's end-of-sequence ids stop it too
    speculation: SpeculationBounds = field(default_factory=SpeculationBounds)
    constraint: Constraint | None = None
    span: object = None  # the request's trace span (None when tracing is off)
    cache_salt: str = ""  # its prefix-cache blocks are shared only under the same salt
    # the output the client expects, as token ids (OpenAI's Predicted Outputs): drafted
    # from where the output follows it (specd/prediction.py); () = none
    prediction: tuple[int, ...] = ()

    def validate(self, vocab: int, context: int, blocks_needed: int, num_blocks: int) -> None:
        """ValueError with the reason when the engine cannot serve it: `blocks_needed` is
        what prompt + max_new_tokens + 1 take in the KV pool of `num_blocks`."""
        self.params.validate()
        self.speculation.validate()
        if not self.prompt:
            raise ValueError("prompt is empty")
        if self.max_new_tokens <= 0:
            raise ValueError("max_new_tokens must be positive")
        if any(not 0 <= t < vocab for t in self.prompt):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if any(t >= vocab for t, _ in self.params.logit_bias):
            raise ValueError(f"logit_bias token ids must be in [0, {vocab})")
        if any(t >= vocab for t in self.params.allowed_token_ids):
            raise ValueError(f"allowed_token_ids must be in [0, {vocab})")
        if any(t >= vocab for word in self.params.bad_words for t in word):
            raise ValueError(f"bad_words token ids must be in [0, {vocab})")
        if any(not 0 <= t < vocab for t in self.stop_ids):
            raise ValueError(f"stop token ids must be in [0, {vocab})")
        if any(not 0 <= t < vocab for t in self.prediction):
            raise ValueError(f"prediction token ids must be in [0, {vocab})")
        if len(self.prediction) > context:
            raise ValueError(
                f"the prediction has {len(self.prediction)} tokens, more than the context"
                f" ({context})"
            )
        if self.params.min_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_tokens ({self.params.min_tokens}) exceeds max_new_tokens "
                f"({self.max_new_tokens})"
            )
        if len(self.prompt) + self.max_new_tokens > context:
            raise ContextExceeded(context, len(self.prompt), self.max_new_tokens)
        if blocks_needed > num_blocks:
            raise ValueError(
                f"request needs {blocks_needed} KV blocks; the pool has {num_blocks}"
                " (the verifier's --num-blocks or --kv-cache-bytes size it)"
            )
