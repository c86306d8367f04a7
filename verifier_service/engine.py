"""The verifier engine: continuous batching with speculative verification.

One step, each phase handing the next what it made and nothing going back:
  schedule (scheduler.py: a frozen plan of slots, every KV reservation made)
  -> draft (drafting.py: proposals cut to the plan and to grammars)
  -> ONE batched target forward (query length k_i + 1 + leaves per decoding sequence,
     k_i = 0 is plain decode; prefill chunks ride along)
  -> verify (verify.py: a Verdict per sequence)
  -> commit (KV kept up to the accepted drafts; tokens and stop checks on the Sequence).
The engine is synchronous; frontend.py runs its steps for asyncio callers.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from opentelemetry import trace

from specd.config import DEFAULT_KV_TOKENS, EngineConfig, chunk_invariant, prefix_cache_on
from specd.grammar import Grammars
from specd.models.paged_kv import PagedKV
from specd.proposal import Proposer
from verifier_service.drafting import Round, draft_rounds
from verifier_service.request import Request
from verifier_service.scheduler import Scheduler, Slot
from verifier_service.sequence import Sequence, SpecStats, StepOutput
from verifier_service.tree import moves
from verifier_service.verify import Verdict, verify_rounds

log = logging.getLogger(__name__)


def graph_rows(config: EngineConfig) -> int:
    """The most rows a decode/verification step feeds: every sequence at the largest k,
    plus the tree's leaves (CUDA graphs are captured up to it)."""
    rows = config.max_batch_size * (config.max_draft_tokens + 1) + config.max_tree_tokens
    return min(rows, config.max_batched_tokens)


@dataclass(frozen=True)
class EngineLoad:
    """What the engine carries right now (for load reports, metrics, admission)."""

    kv_blocks_total: int
    kv_blocks_used: int
    running: int
    waiting: int
    spec_running: int  # running sequences that may draft
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache, since start
    prefix_hits: int = 0  # of which found there (their K/V not computed again)

    @property
    def kv_utilization(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


class Engine:
    def __init__(
        self,
        model,
        config: EngineConfig | None = None,
        proposer: Proposer | None = None,
        eos_ids: set[int] | None = None,
        telemetry=None,
        tokenizer=None,
    ):
        self.model = model
        # constrained requests need the tokenizer (llguidance reads its tokens' bytes)
        vocab = model.args.vocab_size
        self.grammars = None if tokenizer is None else Grammars(tokenizer, vocab, eos_ids)
        self.config = config or EngineConfig()
        bs, budget = self.config.block_size, self.config.kv_cache_bytes
        num_blocks = self.config.num_blocks or (
            PagedKV.blocks_for_budget(model, budget, bs) if budget else -(-DEFAULT_KV_TOKENS // bs)
        )
        if model.gpu is not None and not self.config.batch_invariant:
            model.gpu.tile = 0  # one GEMM a step: faster, a row's bits depend on the batch
        prefix_cache = prefix_cache_on(self.config.prefix_cache, model)
        self.kv = PagedKV.for_model(model, num_blocks, bs, prefix_cache)
        model.prepare_steps(self.kv, self.config.max_batch_size, graph_rows(self.config))
        mib = PagedKV.bytes_per_block(model, bs) * num_blocks / 2**20
        log.info("KV cache: %d blocks of %d (%d tokens, %.0f MiB, %s); prefix cache %s",
                 num_blocks, bs, num_blocks * bs, mib, str(model.kv_dtype).removeprefix("torch."),
                 "on" if prefix_cache else "off")  # fmt: skip
        self.scheduler = Scheduler(self.kv.allocator, self.config, chunk_invariant(model))
        self.proposer = proposer
        self.eos_ids = frozenset(eos_ids or ())
        self._ids = itertools.count()
        self._seqs: dict[int, Sequence] = {}
        self._aborts: list[int] = []
        self._lock = threading.Lock()
        self.totals = SpecStats()  # every round since start (for load reports and metrics)
        self.tree_rounds = self.branches_taken = 0  # rounds with alternatives; won by one
        self.tracer = telemetry.tracer if telemetry is not None and telemetry.tracing else None
        # called once in each step that runs the model, where the step's Python ends and
        # the thread goes to wait (on the drafter's round where the step drafts, else on
        # the native forward): frontend.py hands the last step's outputs on there
        self.before_forward: Callable[[], None] | None = None

    # -- requests ----------------------------------------------------------------------------
    def add_request(self, request: Request) -> int:
        """Queue a request (ValueError when it cannot be served); -> its sequence id."""
        args, alloc = self.model.args, self.kv.allocator
        need = alloc.blocks_for(len(request.prompt) + request.max_new_tokens + 1)
        request.validate(args.vocab_size, args.max_position_embeddings, need, alloc.num_blocks)
        grammar = None
        if request.constraint is not None:
            if self.grammars is None:
                raise ValueError("this verifier was started without a tokenizer: no constraints")
            grammar = self.grammars.start(request.constraint)
        seq = Sequence.start(next(self._ids), request, self.eos_ids, grammar)
        with self._lock:
            self._seqs[seq.seq_id] = seq
            self.scheduler.add(seq)
        return seq.seq_id

    def abort(self, seq_id: int) -> None:
        """Stop a request; its KV blocks (both caches) are freed before the next step."""
        with self._lock:
            self._aborts.append(seq_id)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._aborts)

    def sequence(self, seq_id: int) -> Sequence | None:
        return self._seqs.get(seq_id)

    def load(self) -> EngineLoad:
        alloc, running = self.kv.allocator, list(self.scheduler.running)
        return EngineLoad(
            kv_blocks_total=alloc.num_blocks,
            kv_blocks_used=alloc.num_used,
            running=len(running),
            waiting=len(self.scheduler.waiting),
            spec_running=sum(1 for s in running if s.num_draft > 0),
            prefix_queries=alloc.asked_tokens,
            prefix_hits=alloc.cached_tokens,
        )

    def acceptance_by_route(self) -> dict[str, float]:
        return self.scheduler.controller.routes.rates()

    # -- one step ----------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        outputs = self._apply_aborts()
        plan = self.scheduler.schedule()
        if not plan:
            return outputs
        if self.tracer is None:
            return outputs + self._run_step(plan)
        # one batch serves many requests: link the step span to theirs, never parent it
        links = [trace.Link(s.seq.span.get_span_context()) for s in plan if s.seq.span]
        with self.tracer.start_as_current_span("specd.engine.step", links=links) as span:
            span.set_attribute("specd.batch_size", len(plan))
            return outputs + self._run_step(plan)

    def _run_step(self, plan: tuple[Slot, ...]) -> list[StepOutput]:
        t0 = time.perf_counter()
        drafting = any(s.decode and s.k for s in plan)
        if drafting:  # the thread waits from here on the drafter's round
            self._leaving_python()
        rounds = draft_rounds(plan, self.proposer, self.model.args.vocab_size)
        t1 = time.perf_counter()
        if not drafting:
            self._leaving_python()
        logits = self._forward(rounds)
        t2 = time.perf_counter()
        catch_up = _catch_up(rounds)  # before the commit moves the sequences on
        lookup = _lookup_only(rounds)
        shape = None if lookup else _step_shape(rounds, catch_up)
        sampling = [r for r in rounds if r.num_logits > 0]
        verdicts = verify_rounds(sampling, logits, self.model.args.vocab_size)
        outputs = [self._commit(r, verdicts.get(r.slot.seq_id)) for r in rounds]
        self._measure(rounds, None if catch_up or lookup else t1 - t0, t2 - t1)
        if shape is not None:
            ks, catch_up, stopping = shape
            seconds = time.perf_counter() - t0
            self.scheduler.controller.costs.record_step(ks, seconds, catch_up, stopping)
        return [out for out in outputs if out is not None]

    def _leaving_python(self) -> None:
        if self.before_forward is not None:
            self.before_forward()

    def _forward(self, rounds: list[Round]) -> torch.Tensor:
        decode_only = all(r.slot.decode for r in rounds)
        self.model.batch_invariant = self.config.batch_invariant and decode_only
        return self.model.forward(self.kv, [r.seq_input() for r in rounds])

    def _measure(self, rounds: list[Round], draft_s: float | None, forward_s: float) -> None:
        """Feed the controller this step's parts: a steady drafter round by sequences
        (None: the drafter caught up first, on a new prompt or tokens decoded plain, which
        the switch curve prices: a fresh verifier's first round, 40 prompt tokens in
        0.35 s against ~0.03 s steady, priced every unmeasured k = 1 step at ~0.45 s; or
        every round was an n-gram lookup, `_lookup_only`), and the forward by rows when it
        was decode and verification only (prefill apart)."""
        costs = self.scheduler.controller.costs
        drafted = [r.k for r in rounds if r.proposal is not None]
        if draft_s is not None:
            costs.record_draft(len(drafted), max(drafted, default=0), draft_s)
        if all(r.slot.decode for r in rounds):
            costs.record_forward(sum(r.num_logits for r in rounds), forward_s)

    # -- commit ------------------------------------------------------------------------------
    def _commit(self, r: Round, verdict: Verdict | None) -> StepOutput | None:
        seq = r.seq
        if verdict is None:  # a non-final prefill chunk
            seq.num_cached += len(r.slot.tokens)
            self.kv.allocator.publish(seq.seq_id, seq.tokens)
            return None
        self._account(r, verdict.accepted)
        if verdict.path is not None:
            self._keep_path(r, verdict.path)
        # keep the fed tokens up to the last accepted draft; the new last token is pending
        seq.num_cached += len(r.slot.tokens) + verdict.accepted
        self.kv.allocator.truncate_to(seq.seq_id, seq.num_cached)
        self.kv.allocator.publish(seq.seq_id, seq.tokens)  # the cached part is final
        new = seq.append(verdict.tokens)
        if seq.finish_reason:
            self._finish(seq)
        out = StepOutput(seq.seq_id, new, seq.finish_reason, r.k, verdict.accepted)
        out.decision = (r.slot.decision.reason, r.slot.decision.gain)
        if seq.finish_reason:
            out.stats = seq.stats
            out.timing = (seq.t_arrived, seq.t_scheduled, seq.t_first_token)
        return out

    def _account(self, r: Round, accepted: int) -> None:
        """The round's counts: on the sequence, its route's acceptance, the totals."""
        seq, k = r.seq, r.k
        if r.slot.decode:
            seq.decided(r.slot.decision.reason, r.slot.k)
        seq.stats.record(k, accepted)
        # the controller learns the round as planned (a round the drafter stopped short
        # missed the position after its last draft), as its step costs are measured
        planned = r.slot.k if k else 0  # drafts come only to decode slots of k > 0
        controller = self.scheduler.controller
        controller.record(seq.speculation.route, seq.positions, planned, accepted, k)
        self.totals.record(k, accepted)
        if seq.span is not None and k:
            seq.span.add_event("speculation.round", {"k": k, "accepted": accepted})

    def _keep_path(self, r: Round, path: list[int]) -> None:
        """A tree round: an accepted alternative's K/V goes where the chain's would."""
        self.tree_rounds += 1
        root = r.seq.num_cached + len(r.slot.tokens) - 1
        shifted = moves(root, path)
        if shifted:
            self.branches_taken += 1
            self.kv.move(r.seq.seq_id, shifted)

    def _finish(self, seq: Sequence) -> None:
        seq.stats.reason = seq.speculation.reason(seq.decisions, seq.stats.rounds)
        self.scheduler.remove(seq)
        if self.proposer is not None:
            self.proposer.close(seq.seq_id)
        with self._lock:
            self._seqs.pop(seq.seq_id, None)

    def _apply_aborts(self) -> list[StepOutput]:
        with self._lock:
            aborts, self._aborts = self._aborts, []
        out = []
        for seq_id in aborts:
            seq = self._seqs.get(seq_id)
            if seq is not None and seq.finish_reason is None:
                seq.finish_reason = "abort"
                self._finish(seq)
                out.append(StepOutput(seq_id, [], "abort", stats=seq.stats))
        return out

    def fail_all(self) -> list[StepOutput]:
        """Finish every request with reason "error" and free its KV (both caches)."""
        with self._lock:
            seqs = list(self._seqs.values())
        out = []
        for seq in seqs:
            seq.finish_reason = "error"
            try:
                self._finish(seq)
            except Exception:  # noqa: BLE001 - freeing must not stop the others
                log.exception("could not free sequence %d", seq.seq_id)
            out.append(StepOutput(seq.seq_id, [], "error", stats=seq.stats))
        return out


def _catch_up(rounds: list[Round]) -> int:
    """Tokens the drafter catches up on for the sequences drafting this step (a first
    round prefills the prompt; a sequence back from plain, what it skipped)."""
    return sum(r.seq.drafter_behind for r in rounds if r.slot.k)


def _lookup_only(rounds: list[Round]) -> bool:
    """Whether the step drafted and every round's drafts were an n-gram continuation: no
    draft model ran, so neither the drafter round nor the whole step says what a round of
    the draft model costs. Priced with the others (code at c = 1: a sixth of the steps,
    ~60 ms against ~110 for a model's round of 6), they cut the price of whichever depth
    was running and swung the machine's pace by ~12% each, so that the held prices of
    depths 4 and 6 stood ~29% and ~15% under their steps, and `auto` ran k = 4 where
    k = 6 was best (BENCHMARKS.md section 58)."""
    drafted = [r.proposal for r in rounds if r.proposal is not None and r.k]
    return bool(drafted) and all(p.ngram for p in drafted)


def _step_shape(rounds: list[Round], catch_up: int) -> tuple[list[int], int, int] | None:
    """What a whole decode step's cost is measured by: the drafts that came for each
    sequence (a round planned at k comes short where the drafter stops early; the
    controller prices a plan by how deep its rounds are expected to go), the tokens the
    drafter catches up on for those switching to drafting (a first round prefills the
    prompt), and how many switch to plain after drafting (the drafter still drafts ahead
    for them on the same cores: 74 ms for a 59 ms plain step). None when the step was not
    decode only (prefill costs apart), or when a round planned to draft got nothing (a
    drafter that failed or timed out: neither a plain nor a drafting step's price)."""
    if not all(r.slot.decode for r in rounds) or any(r.slot.k and not r.k for r in rounds):
        return None
    stopping = sum(1 for r in rounds if not r.slot.k and not r.seq.drafter_behind)
    return [r.k for r in rounds], catch_up, stopping
