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
from collections.abc import AsyncIterator

import torch

from drafter_service.proposer import DraftState, Proposal, Proposer
from specd.config import EngineConfig
from specd.models.paged_kv import PagedKV, SeqInput
from specd.sampling import SamplingParams, make_generator
from verifier_service.scheduler import Scheduler, Work
from verifier_service.sequence import Sequence, SpecStats, StepOutput
from verifier_service.verify import verify_rounds

log = logging.getLogger(__name__)


class Engine:
    def __init__(
        self,
        model,
        config: EngineConfig | None = None,
        proposer: Proposer | None = None,
        eos_ids: set[int] | None = None,
    ):
        self.model = model
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

    # -- requests ----------------------------------------------------------------------------
    def add_request(
        self,
        prompt: list[int],
        params: SamplingParams | None = None,
        max_new_tokens: int = 64,
        num_draft: int = 0,
        stop_ids: set[int] | None = None,
        ignore_eos: bool = False,
    ) -> int:
        params = params or SamplingParams()
        params.validate()
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
        stops = set(stop_ids or ()) | (set() if ignore_eos else set(self.eos_ids))
        seq = Sequence(
            next(self._ids),
            list(prompt),
            params,
            max_new_tokens,
            max(0, num_draft),
            frozenset(stops),
            make_generator(params.seed),
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
        proposals = self._propose([w for w in work if w.decode and w.k > 0])
        logits = self._forward(work, proposals)
        rounds = [w for w in work if w.num_logits > 0]
        emitted = verify_rounds(rounds, proposals, logits, self.model.args.vocab_size)
        for w in work:
            outputs.extend(self._commit(w, proposals.get(w.seq.seq_id), emitted.get(id(w))))
        return outputs

    def _propose(self, work: list[Work]) -> dict[int, Proposal]:
        if not work or self.proposer is None:
            return {}
        states = [DraftState(w.seq.seq_id, w.seq.tokens, w.seq.params, w.k) for w in work]
        try:
            proposals = self.proposer.propose(states)
        except Exception:  # a failed drafter costs speculation, never the request
            log.exception("drafter failed; decoding without drafts this round")
            return {}
        out = {}
        for w, p in zip(work, proposals, strict=True):
            p.tokens = p.tokens[: w.k]
            out[w.seq.seq_id] = p
        return out

    def _forward(self, work: list[Work], proposals: dict[int, Proposal]) -> torch.Tensor:
        inputs = []
        for w in work:
            drafts = proposals[w.seq.seq_id].tokens if w.seq.seq_id in proposals else []
            w.k = len(drafts)
            if w.decode:
                w.num_logits = 1 + w.k
            inputs.append(SeqInput(w.seq.seq_id, w.tokens + drafts, w.num_logits))
        invariant = self.config.batch_invariant and all(w.decode for w in work)
        self.model.batch_invariant = invariant
        return self.model.forward(self.kv, inputs)

    def _commit(self, w: Work, proposal: Proposal | None, emitted) -> list[StepOutput]:
        seq = w.seq
        if emitted is None:  # a non-final prefill chunk
            seq.num_cached += len(w.tokens)
            return []
        tokens, accepted = emitted
        seq.stats.record(w.k, accepted)
        self.totals.record(w.k, accepted)
        # keep the fed tokens up to the last accepted draft; the new last token is pending
        seq.num_cached += len(w.tokens) + accepted
        self.kv.allocator.truncate_to(seq.seq_id, seq.num_cached)
        new = []
        for t in tokens:
            seq.tokens.append(t)
            new.append(t)
            if t in seq.stop_ids:
                seq.finish_reason = "stop"
            elif seq.num_generated >= seq.max_new_tokens:
                seq.finish_reason = "length"
            if seq.finish_reason:
                break
        if seq.finish_reason:
            self._finish(seq)
        stats = seq.stats if seq.finish_reason else None
        return [StepOutput(seq.seq_id, new, seq.finish_reason, w.k, accepted, stats)]

    def _finish(self, seq: Sequence) -> None:
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
            outputs = await asyncio.to_thread(self.step)
            for out in outputs:
                queue = self._queues.get(out.seq_id)
                if queue is not None:
                    queue.put_nowait(out)
