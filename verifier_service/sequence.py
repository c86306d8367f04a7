"""One request's state inside the engine, how a step's tokens land on it, and what a step
hands back for it."""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from specd.draws import make_generator
from specd.grammar import GrammarState
from specd.infill_filter import InfillFilter
from specd.params import SamplingParams
from specd.prediction import Prediction
from specd.proposal import view_start
from verifier_service.request import Request, SpeculationBounds

log = logging.getLogger(__name__)


@dataclass
class SpecStats:
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    lookup_rounds: int = 0  # rounds drafted by a lookup (no draft model ran)
    # of drafted and accepted, those the client's predicted output drafted
    predicted_drafted: int = 0
    predicted_accepted: int = 0
    reason: str = ""  # set when the request finishes (SpeculationBounds.reason)

    def record(self, k: int, a: int, lookup: bool = False, predicted: bool = False) -> None:
        if k == 0:
            return
        self.rounds += 1
        self.drafted += k
        self.accepted += a
        self.lookup_rounds += lookup
        if predicted:
            self.predicted_drafted += k
            self.predicted_accepted += a

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per speculation round (accepted + the recovered/bonus one)."""
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0


@dataclass(eq=False)  # a request is itself: the scheduler's lists find it by identity
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
    prompt_hits: int | None = None  # prompt tokens the prefix cache held at first admission
    finish_reason: str | None = None
    error: str | None = None  # finish_reason "error": why, where the request is at fault
    stats: SpecStats = field(default_factory=SpecStats)
    span: object = None  # the request's trace span (None when tracing is off)
    t_arrived: int = field(default_factory=time.time_ns)
    t_scheduled: int = 0  # first prefill chunk
    t_first_token: int = 0
    speculation: SpeculationBounds = field(default_factory=lambda: SpeculationBounds())
    decisions: Counter = field(default_factory=Counter)  # reason -> decode steps
    off_steps: int = 0  # decode steps since the last round that drafted (for probes)
    grammar: GrammarState | None = None  # a constrained request's state at `tokens`
    infill: InfillFilter | None = None  # llama.cpp's infill sampler, where params ask for it
    # SamplingParams.prompt_logprobs: a TokenLogprob per prompt token after the first, as
    # its rows are computed (handed out with the first token: `take_prompt_logprobs`)
    prompt_logprobs: list = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    cache_salt: str = ""  # the prefix cache's salt (Request.cache_salt)
    drafter_window: int = 0  # the drafter's context window (specd.proposal.view_start)
    prediction: Prediction | None = None  # the client's predicted output (Request.prediction)
    num_predicted: int = 0  # k a round drafted from the prediction may take (0: none)

    def __post_init__(self):
        if not self.tokens:
            self.tokens = list(self.prompt)

    @classmethod
    def start(cls, seq_id: int, request: Request, eos_ids, grammar=None, infill=None) -> Sequence:
        stops = set(request.stop_ids) | (set() if request.ignore_eos else set(eos_ids))
        return cls(
            seq_id,
            list(request.prompt),
            request.params,
            request.max_new_tokens,
            max(0, request.num_draft),
            frozenset(stops),
            make_generator(request.params.seed),
            span=request.span,
            speculation=request.speculation,
            grammar=grammar,
            infill=infill,
            cache_salt=request.cache_salt,
            prediction=Prediction(request.prediction) if request.prediction else None,
        )

    @property
    def wants_prompt_rows(self) -> bool:
        """Its prompt's rows are still to be read for log-probabilities (not after its
        first token: a preempted sequence's recomputed prompt is not read again)."""
        return self.params.prompt_logprobs is not None and not self.prompt_logprobs_sent

    def take_prompt_logprobs(self) -> list | None:
        """The prompt's log-probabilities, once (None: not asked for, or sent already)."""
        if self.params.prompt_logprobs is None or self.prompt_logprobs_sent:
            return None
        self.prompt_logprobs_sent = True
        out, self.prompt_logprobs = self.prompt_logprobs, []
        return out

    @property
    def following(self) -> bool:
        """Its next round drafts from its prediction (the output follows it)."""
        p = self.prediction
        return p is not None and p.follows(self.tokens, len(self.prompt))

    @property
    def acceptance_key(self) -> str:
        """Whose acceptance its next round drafts at (SpeculationBounds.acceptance_key):
        its prediction's while the output follows it, else its route's drafter's."""
        return self.speculation.acceptance_key(self.following)

    @property
    def draft_cap(self) -> int:
        """The most drafts its next round may take: its prediction's k while the output
        follows it, else the k it asked for."""
        return self.num_predicted if self.num_predicted and self.following else self.num_draft

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - len(self.prompt)

    @property
    def adjusts_logits(self) -> bool:
        """Whether its next tokens are chosen from adjusted logits: a bias, a penalty, bad
        words, or stop tokens still banned by min_tokens (see `ban_early_stops`)."""
        early = self.num_generated < self.params.min_tokens
        return self.params.adjusts_logits or early or bool(self.params.bad_words)

    def ban_early_stops(self, logits: torch.Tensor, paths: list[list[int]]) -> torch.Tensor:
        """logits [R, V], row n after the committed tokens and paths[n] -> the rows that
        choose a token before the min_tokens-th with every stop token at -inf (vLLM's
        min_tokens: neither end-of-sequence nor a stop token may end the output sooner)."""
        early = [
            n
            for n, path in enumerate(paths)
            if self.num_generated + len(path) < self.params.min_tokens
        ]
        if not early or not self.stop_ids:
            return logits
        logits = logits.clone()
        rows = torch.tensor(early, device=logits.device)[:, None]
        cols = torch.tensor(sorted(self.stop_ids), device=logits.device)[None, :]
        logits[rows, cols] = float("-inf")
        return logits

    def ban_bad_words(self, logits: torch.Tensor, paths: list[list[int]]) -> torch.Tensor:
        """logits [R, V], row n after the committed tokens and paths[n] -> the rows with
        each bad word's last token at -inf where the output so far (the generated tokens,
        then the path) ends with the word's others (vLLM's bad_words)."""
        words = self.params.bad_words
        if not words:
            return logits
        generated = self.tokens[len(self.prompt) :]
        banned = []
        for n, path in enumerate(paths):
            out = generated + list(path)
            for word in words:
                head = list(word[:-1])
                if not head or (len(out) >= len(head) and out[len(out) - len(head) :] == head):
                    banned.append((n, word[-1]))
        if not banned:
            return logits
        logits = logits.clone()
        rows, cols = zip(*banned, strict=True)
        at = logits.device
        logits[torch.tensor(rows, device=at), torch.tensor(cols, device=at)] = float("-inf")
        return logits

    @property
    def prefilling(self) -> bool:
        """True until the first token exists (the pending token is then never cached)."""
        return self.num_generated == 0

    @property
    def drafter_behind(self) -> int:
        """Tokens the drafter catches up on before it can draft for this sequence: the
        context before its first round (what of it the drafter's window holds), what was
        decoded plain since its last one, 0 while it drafts every step."""
        if not self.stats.rounds:
            return len(self.tokens) - view_start(len(self.tokens), self.drafter_window)
        return self.off_steps + 1 if self.off_steps else 0

    def decided(self, reason: str, k: int) -> None:
        """A decode step ran with this speculation decision and k drafts."""
        self.decisions[reason] += 1
        self.off_steps = 0 if k else self.off_steps + 1

    def append(self, tokens: list[int]) -> list[int]:
        """Commit a round's tokens up to the first that finishes the request (its
        finish_reason is then set); -> the tokens committed."""
        self.t_first_token = self.t_first_token or time.time_ns()
        for n, token in enumerate(tokens, 1):
            self.tokens.append(token)
            self.finish_reason = self._finished(token)
            if self.finish_reason:
                return tokens[:n]
        return list(tokens)

    @property
    def stopped_at_token(self) -> bool:
        """It finished at one of its stop tokens (end-of-sequence or the request's), the
        last token it committed."""
        return self.finish_reason == "stop" and self.tokens[-1] in self.stop_ids

    def _finished(self, token: int) -> str | None:
        """After committing `token`: "stop" at a stop token or once the constraint is
        complete (a bonus token sampled past that point is dropped), "length", or None."""
        grammar = self.grammar
        if grammar is not None:
            refused = not grammar.consume([token])
            self.error = grammar.error
            if self.error:
                return "error"
            if refused:
                log.error("sequence %d: a token its grammar refuses", self.seq_id)  # masked
        if token in self.stop_ids or (grammar is not None and grammar.done):
            return "stop"
        return "length" if self.num_generated >= self.max_new_tokens else None


@dataclass
class StepOutput:
    seq_id: int
    tokens: list[int]  # newly committed this step (after stop checks)
    finish_reason: str | None  # "stop", "length", "abort", "error" or None while running
    drafted: int = 0
    accepted: int = 0
    lookup: bool = False  # its round's drafts were a lookup, not the draft model's
    stats: SpecStats | None = None  # the request's speculation totals, on its last output
    # last output: arrived, scheduled, first token, finished (ns since the epoch)
    timing: tuple[int, int, int, int] = (0, 0, 0, 0)
    decision: tuple[str, float] = ("", 1.0)  # the controller's reason and predicted gain
    logprobs: list | None = None  # a TokenLogprob per token, where the request asked
    prompt_logprobs: list | None = None  # with the first token: the prompt's, where asked
    stop_token: bool = False  # last output: it stopped at a stop token (Sequence.stopped_at_token)
    prompt_hits: int = 0  # the prompt's tokens found in the prefix cache (Sequence.prompt_hits)
    error: str | None = None  # last output: Sequence.error
