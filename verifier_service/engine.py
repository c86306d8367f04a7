"""The verifier engine: continuous batching with speculative verification.

One step:  schedule -> propose -> ONE batched target forward (query length k_i + 1 per
decoding sequence, k_i = 0 is plain decode; prefill chunks ride along) -> accept ->
commit / truncate_to -> emit.  `generate` is the async API: it runs steps on a worker
thread so the event loop keeps serving while the model runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import torch
from opentelemetry import trace

from specd.config import EngineConfig
from specd.constraint import Constraint
from specd.grammar import Grammars
from specd.kvcache import NoFreeBlocks
from specd.model_thread import on_model_thread
from specd.models.matmul import INVARIANT_TILE
from specd.models.paged_kv import PagedKV, SeqInput
from specd.params import SamplingParams
from specd.proposal import DraftState, Proposal, Proposer
from specd.sampling import make_generator
from verifier_service.scheduler import Scheduler, Work
from verifier_service.sequence import Sequence, SpecStats, SpeculationBounds, StepOutput
from verifier_service.tree import moves, tree_parents
from verifier_service.verify import mask_logits, verify_rounds

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineLoad:
    """What the engine carries right now (for load reports, metrics, admission)."""

    kv_blocks_total: int
    kv_blocks_used: int
    running: int
    waiting: int
    spec_running: int  # running sequences that may draft

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
        num_blocks = self.config.num_blocks or PagedKV.blocks_for_budget(
            model, self.config.kv_cache_bytes, self.config.block_size
        )
        self.kv = PagedKV.for_model(model, num_blocks, self.config.block_size)
        self.scheduler = Scheduler(self.kv.allocator, self.config)
        self.proposer = proposer
        self.eos_ids = frozenset(eos_ids or ())
        self._ids = itertools.count()
        self._seqs: dict[int, Sequence] = {}
        self._aborts: list[int] = []
        self._lock = threading.Lock()
        self._queues: dict[int, asyncio.Queue] = {}
        self._loop_task: asyncio.Task | None = None
        self._wake = asyncio.Event()
        self.totals = SpecStats()  # every round since start (for load reports and metrics)
        self.tree_rounds = self.branches_taken = 0  # rounds with alternatives; won by one
        self.tracer = telemetry.tracer if telemetry is not None and telemetry.tracing else None

    # -- requests ----------------------------------------------------------------------------
    def add_request(
        self,
        prompt: list[int],
        params: SamplingParams | None = None,
        max_new_tokens: int = 64,
        num_draft: int = 0,
        stop_ids: set[int] | None = None,
        ignore_eos: bool = False,
        span=None,
        speculation: SpeculationBounds | None = None,
        constraint: Constraint | None = None,
    ) -> int:
        """Queue a request. `num_draft`: the most drafts per round; with
        `speculation.auto` the controller picks k <= num_draft every step, else every
        round drafts num_draft."""
        params = params or SamplingParams()
        params.validate()
        speculation = speculation or SpeculationBounds()
        speculation.validate()
        if not prompt:
            raise ValueError("prompt is empty")
        if max_new_tokens <= 0:
            raise ValueError("max_new_tokens must be positive")
        vocab = self.model.args.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        limit = self.model.args.max_position_embeddings
        if len(prompt) + max_new_tokens > limit:
            raise ValueError(
                f"prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) "
                f"exceeds the model context ({limit})"
            )
        need = self.kv.allocator.blocks_for(len(prompt) + max_new_tokens + 1)
        if need > self.kv.allocator.num_blocks:
            raise ValueError(
                f"request needs {need} KV blocks; the pool has {self.kv.allocator.num_blocks}"
            )
        grammar = None
        if constraint is not None:
            if self.grammars is None:
                raise ValueError("this verifier was started without a tokenizer: no constraints")
            grammar = self.grammars.start(constraint)
        stops = set(stop_ids or ()) | (set() if ignore_eos else set(self.eos_ids))
        seq = Sequence(
            next(self._ids),
            list(prompt),
            params,
            max_new_tokens,
            max(0, num_draft),
            frozenset(stops),
            make_generator(params.seed),
            span=span,
            speculation=speculation,
            grammar=grammar,
        )
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

    # -- one step ----------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        outputs = self._apply_aborts()
        work = self.scheduler.schedule()
        if not work:
            return outputs
        if self.tracer is None:
            return outputs + self._run_step(work)
        # one batch serves many requests: link the step span to theirs, never parent it
        links = [trace.Link(w.seq.span.get_span_context()) for w in work if w.seq.span]
        with self.tracer.start_as_current_span("specd.engine.step", links=links) as span:
            span.set_attribute("specd.batch_size", len(work))
            return outputs + self._run_step(work)

    def _run_step(self, work: list[Work]) -> list[StepOutput]:
        outputs = []
        t0 = time.perf_counter()
        proposals = self._propose([w for w in work if w.decode and w.k > 0])
        masks = self._constrain(work, proposals)
        self._limit_alternatives(work, proposals)
        t1 = time.perf_counter()
        logits = self._forward(work, proposals)
        self._measure(work, proposals, t1 - t0, time.perf_counter() - t1)
        rounds = [w for w in work if w.num_logits > 0]
        mask_logits(rounds, masks, logits)
        emitted = verify_rounds(rounds, proposals, logits, self.model.args.vocab_size)
        for w in work:
            outputs.extend(self._commit(w, emitted.get(id(w))))
        return outputs

    def _measure(self, work, proposals, draft_s: float, forward_s: float) -> None:
        """Feed the controller this step's costs: a drafter round by sequences, and the
        forward by rows when it was decode and verification only (prefill costs apart)."""
        controller = self.scheduler.controller
        steps = max((len(p.tokens) for p in proposals.values()), default=0)
        controller.record_draft(len(proposals), steps, draft_s)
        if all(w.decode for w in work):
            controller.record_forward(sum(w.num_logits for w in work), forward_s)

    def load(self) -> EngineLoad:
        alloc, running = self.kv.allocator, list(self.scheduler.running)
        return EngineLoad(
            kv_blocks_total=alloc.num_blocks,
            kv_blocks_used=alloc.num_used,
            running=len(running),
            waiting=len(self.scheduler.waiting),
            spec_running=sum(1 for s in running if s.num_draft > 0),
        )

    def acceptance_by_route(self) -> dict[str, float]:
        return self.scheduler.controller.routes.rates()

    def _propose(self, work: list[Work]) -> dict[int, Proposal]:
        if not work or self.proposer is None:
            return {}
        states = [
            DraftState(w.seq.seq_id, w.seq.tokens, w.seq.params, w.k, w.seq.span, w.seq.grammar)
            for w in work
        ]
        try:
            proposals = self.proposer.propose(states)
        except Exception:  # a failed drafter costs speculation, never the request
            log.exception("drafter failed; decoding without drafts this round")
            return {}
        out, vocab = {}, self.model.args.vocab_size
        for w, p in zip(work, proposals, strict=True):
            # a remote drafter is another process: never feed the model an id it lacks
            bad = next((j for j, t in enumerate(p.tokens) if not 0 <= t < vocab), w.k)
            p = p.first(min(w.k, bad))
            p.alts = [(parent, t) for parent, t in p.alts if parent >= 0 and 0 <= t < vocab]
            out[w.seq.seq_id] = p
        return out

    @staticmethod
    def _constrain(work: list[Work], proposals: dict[int, Proposal]) -> dict[int, torch.Tensor]:
        """Cut each constrained sequence's proposal to what its grammar allows (specd/grammar.py)
        -> the masks of its logits, seq_id -> bool [nodes, V] (root, chain, alternatives)."""
        masks = {}
        for w in work:
            grammar = w.seq.grammar
            if grammar is None or w.num_logits == 0:
                continue
            p = proposals.get(w.seq.seq_id)
            if p is None:
                masks[w.seq.seq_id] = grammar.allowed()[None]
            else:
                proposals[w.seq.seq_id], masks[w.seq.seq_id] = grammar.plan(p)
        return masks

    def _limit_alternatives(self, work: list[Work], proposals: dict[int, Proposal]) -> None:
        """Keep alternative leaves only while the step stays small: a forward of up to
        `max_tree_tokens` new tokens costs about one token's on a memory-bound device, past
        it every extra row costs (in batch-invariant mode a sequence's tree then fits its one
        16-row query tile, the shape a chain has). Also off for a sequence whose KV blocks
        cannot take them."""
        limit = self.config.max_tree_tokens
        if self.config.batch_invariant:
            limit = min(limit, INVARIANT_TILE)
        chains = {seq_id: len(p.tokens) for seq_id, p in proposals.items()}
        total = sum(len(w.tokens) + chains.get(w.seq.seq_id, 0) for w in work)
        for w in work:
            p = proposals.get(w.seq.seq_id)
            if p is None or not p.alts:
                continue
            keep = max(0, min(len(p.alts), limit - total))
            if keep:
                try:
                    fed = w.seq.num_cached + len(w.tokens) + len(p.tokens) + keep
                    self.kv.allocator.reserve(w.seq.seq_id, fed)
                except NoFreeBlocks:
                    keep = 0
            p.alts = p.alts[:keep]
            total += keep

    def _forward(self, work: list[Work], proposals: dict[int, Proposal]) -> torch.Tensor:
        inputs = []
        for w in work:
            p = proposals.get(w.seq.seq_id)
            if p is None:  # prefill, plain decode, or a round the drafter could not serve
                w.k = 0
                w.num_logits = 1 if w.decode else w.num_logits
                inputs.append(SeqInput(w.seq.seq_id, w.tokens, w.num_logits))
                continue
            w.k = len(p.tokens)
            alts = [t for _, t in p.alts]
            w.num_logits = 1 + w.k + len(alts)
            parents = tree_parents(len(w.tokens), p) if alts else None
            inputs.append(SeqInput(w.seq.seq_id, w.tokens + p.tokens + alts, w.num_logits, parents))
        invariant = self.config.batch_invariant and all(w.decode for w in work)
        self.model.batch_invariant = invariant
        return self.model.forward(self.kv, inputs)

    def _commit(self, w: Work, emitted) -> list[StepOutput]:
        seq = w.seq
        if emitted is None:  # a non-final prefill chunk
            seq.num_cached += len(w.tokens)
            return []
        tokens, accepted, path = emitted
        seq.stats.record(w.k, accepted)
        seq.positions.record(w.k, accepted)
        self.scheduler.controller.routes.record(seq.speculation.route, w.k, accepted)
        self.totals.record(w.k, accepted)
        if seq.span is not None and w.k:
            seq.span.add_event("speculation.round", {"k": w.k, "accepted": accepted})
        seq.t_first_token = seq.t_first_token or time.time_ns()
        if path is not None:
            self.tree_rounds += 1
            root = seq.num_cached + len(w.tokens) - 1
            shifted = moves(root, path)  # an accepted alternative goes where the chain's would
            if shifted:
                self.branches_taken += 1
                self.kv.move(seq.seq_id, shifted)
        # keep the fed tokens up to the last accepted draft; the new last token is pending
        seq.num_cached += len(w.tokens) + accepted
        self.kv.allocator.truncate_to(seq.seq_id, seq.num_cached)
        new = []
        for t in tokens:
            seq.tokens.append(t)
            new.append(t)
            seq.finish_reason = self._finished(seq, t)
            if seq.finish_reason:
                break
        if seq.finish_reason:
            self._finish(seq)
        out = StepOutput(seq.seq_id, new, seq.finish_reason, w.k, accepted)
        out.decision = seq.step_decision
        if seq.finish_reason:
            out.stats = seq.stats
            out.timing = (seq.t_arrived, seq.t_scheduled, seq.t_first_token)
        return [out]

    @staticmethod
    def _finished(seq: Sequence, token: int) -> str | None:
        """After committing `token`: "stop" at a stop token or once the constraint is
        complete (a bonus token sampled past that point is dropped), "length", or None."""
        if seq.grammar is not None and not seq.grammar.consume([token]):
            log.error("sequence %d: a token its grammar refuses", seq.seq_id)  # masked: never
        if token in seq.stop_ids or (seq.grammar is not None and seq.grammar.done):
            return "stop"
        return "length" if seq.num_generated >= seq.max_new_tokens else None

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

    def _fail_all(self) -> list[StepOutput]:
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

    def sequence(self, seq_id: int) -> Sequence | None:
        return self._seqs.get(seq_id)

    # -- async API -----------------------------------------------------------------------------
    async def generate(
        self, prompt: list[int], params: SamplingParams | None = None, **kwargs
    ) -> AsyncIterator[StepOutput]:
        """Yield each step's new tokens for one request; the last output has finish_reason.
        Leaving early (cancel, break) aborts the request and frees its KV."""
        seq_id = self.add_request(prompt, params, **kwargs)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[seq_id] = queue
        self._ensure_loop()
        finished = False
        try:
            while not finished:
                out = await queue.get()
                finished = out.finish_reason is not None
                yield out
        finally:
            self._queues.pop(seq_id, None)
            if not finished:
                self.abort(seq_id)
                self._ensure_loop()

    def _ensure_loop(self) -> None:
        self._wake.set()
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        """Stop the engine loop (the servers call this on shutdown)."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task

    async def _run(self) -> None:
        while True:
            if not self.has_work():
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                outputs = await on_model_thread("verifier", self.step)  # specd/model_thread.py
            except Exception:  # never leave requests waiting on a dead loop
                log.exception("engine step failed; failing the running requests")
                outputs = self._fail_all()
            for out in outputs:
                queue = self._queues.get(out.seq_id)
                if queue is not None:
                    queue.put_nowait(out)
