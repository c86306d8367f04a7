"""Which sequences run in the next forward, with how many tokens and how many drafts.

Running sequences decode first (1 pending token + k drafts each, k from the speculation
controller for `auto` requests); the rest of the token budget goes to prefill chunks.
Admission reserves KV blocks for the prompt + (k + 1).
When blocks run short a sequence's k is lowered first; if even k = 0 does not fit, the
newest running sequence is preempted (its blocks freed, recomputed later).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from specd.config import EngineConfig
from specd.kvcache import BlockAllocator, NoFreeBlocks
from verifier_service.controller import (
    Candidate,
    Controller,
    ControllerConfig,
    Plan,
    expected_tokens,
)
from verifier_service.sequence import Sequence


@dataclass
class Work:
    seq: Sequence
    tokens: list[int]  # new tokens for the forward (decode: the pending token; drafts later)
    k: int  # drafts allowed (decode only)
    num_logits: int  # prefill: 1 on the last chunk of a fresh prompt, else 0; decode: 1 + k

    @property
    def decode(self) -> bool:
        return not self.seq.prefilling and self.seq.num_cached == len(self.seq.tokens) - 1


def prefill_target(seq: Sequence) -> int:
    """Tokens to cache before decoding: all of a fresh prompt (its last position's logits
    give the first token); all but the pending token once tokens were generated."""
    return len(seq.tokens) - (0 if seq.prefilling else 1)


class Scheduler:
    def __init__(self, allocator: BlockAllocator, config: EngineConfig):
        self.allocator = allocator
        self.config = config
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._last_was_prefill = False
        self._batch_history: deque[tuple[float, int]] = deque()
        # costs and acceptance, measured by the engine
        self.controller = Controller(ControllerConfig(costs=config.cost_model))
        self.last_plan = Plan([], [], 1.0)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.allocator.free(seq.seq_id)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[Work]:
        budget = self.config.max_batched_tokens
        decode = self._schedule_decode(budget)
        budget -= sum(1 + w.k for w in decode)
        if self.config.batch_invariant and decode:
            # decode/verification forwards must not mix with prefill (different kernels);
            # alternate when both are waiting so neither starves, and decode whenever no
            # prefill can be scheduled (e.g. the batch is full)
            if self._wants_prefill() and not self._last_was_prefill:
                prefill = self._schedule_prefill(self.config.max_batched_tokens)
                if prefill:
                    self._last_was_prefill = True
                    return prefill
            self._last_was_prefill = False
            return decode
        prefill = self._schedule_prefill(budget)
        self._last_was_prefill = bool(prefill) and not decode
        return decode + prefill

    def _wants_prefill(self) -> bool:
        return bool(self.waiting) or any(s.num_cached < prefill_target(s) for s in self.running)

    def _recent_batch(self) -> int:
        """The largest batch (running + waiting) over the last `draft_gate_memory_s`: a
        one-step dip (a request finished, the next not yet admitted) must not switch the
        whole batch to drafting, whose catch-up forward costs more than that step gains."""
        now, size = time.monotonic(), len(self.running) + len(self.waiting)
        history = self._batch_history
        history.append((now, size))
        while history[0][0] < now - self.config.draft_gate_memory_s:
            history.popleft()
        return max(n for _, n in history)

    def _schedule_decode(self, budget: int) -> list[Work]:
        ready = [s for s in self.running if s.num_cached >= prefill_target(s)]
        ks = self._draft_counts(ready)
        work = []
        for seq, k in zip(ready, ks, strict=True):
            if seq not in self.running:
                continue  # preempted by an earlier sequence's reservation
            k = self._fit(seq, max(0, min(k, budget - 1)))
            if k is None:
                continue
            budget -= 1 + k
            work.append(Work(seq, [seq.tokens[-1]], k, 1 + k))
            if budget <= 0:
                break
        return work

    def _draft_counts(self, ready: list[Sequence]) -> list[int]:
        """Drafts per decoding sequence: none past its route's batch or KV bound; else
        `auto` ones by the controller, the others as asked. Records each step's reason on
        the sequence."""
        recent = self._recent_batch()
        kv_used = self.allocator.utilization()
        ks, reasons, candidates, fixed_rows, fixed_tokens = [], [], [], 0, 0.0
        for seq in ready:
            bounds = seq.speculation
            remaining = seq.max_new_tokens - seq.num_generated
            k = max(0, min(seq.num_draft, self.config.max_draft_tokens, remaining - 1))
            accept = self.controller.accept_rates(bounds.route, seq.positions)
            reason = None
            if k and bounds.draft_below_batch and recent >= bounds.draft_below_batch:
                k, reason = 0, "off:batch"
            elif k and kv_used > bounds.max_kv_utilization:
                k, reason = 0, "off:kv"
            elif k and bounds.auto:
                probe = seq.off_steps + 1 >= self.controller.config.probe_every
                candidates.append(Candidate(k, accept, probe, bounds.min_acceptance))
                ks.append(None)
                reasons.append(None)
                continue
            ks.append(k)
            reasons.append(reason or ("on" if k else "off:request"))
            fixed_rows += 1 + k
            fixed_tokens += expected_tokens(accept, k)
        plan = self.controller.plan(candidates, fixed_rows, fixed_tokens)
        self.last_plan = plan
        chosen = iter(zip(plan.ks, plan.reasons, strict=True))
        out = []
        for seq, k, reason in zip(ready, ks, reasons, strict=True):
            gain = 1.0
            if k is None:
                (k, reason), gain = next(chosen), plan.gain
            seq.decisions[reason] += 1
            seq.step_decision = (reason, gain)
            seq.off_steps = 0 if k else seq.off_steps + 1
            out.append(k)
        return out

    def _fit(self, seq: Sequence, k: int) -> int | None:
        """Reserve blocks for 1 + k new tokens, lowering k, then preempting others."""
        while True:
            for kk in range(k, -1, -1):
                try:
                    self.allocator.reserve(seq.seq_id, seq.num_cached + 1 + kk)
                    return kk
                except NoFreeBlocks:
                    continue
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return None

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.allocator.free(seq.seq_id)
        seq.num_cached = 0
        self.waiting.appendleft(seq)

    def _schedule_prefill(self, budget: int) -> list[Work]:
        work = []
        for seq in self.running:  # chunked prefills already admitted
            if budget <= 0:
                break
            if seq.num_cached < prefill_target(seq):
                w = self._chunk(seq, budget)
                budget -= len(w.tokens)
                work.append(w)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_batch_size:
            seq = self.waiting[0]
            k = min(seq.num_draft, self.config.max_draft_tokens)  # the most it may draft
            try:
                self.allocator.allocate(seq.seq_id, reserve_tokens=len(seq.tokens) + k + 1)
            except NoFreeBlocks:
                break
            self.waiting.popleft()
            self.running.append(seq)
            w = self._chunk(seq, budget)
            budget -= len(w.tokens)
            work.append(w)
        return work

    def _chunk(self, seq: Sequence, budget: int) -> Work:
        seq.t_scheduled = seq.t_scheduled or time.time_ns()
        seq.step_decision = ("", 1.0)  # a prefill chunk decides no speculation
        end = min(prefill_target(seq), seq.num_cached + budget)
        last = end == prefill_target(seq) and seq.prefilling
        return Work(seq, seq.tokens[seq.num_cached : end], 0, 1 if last else 0)
