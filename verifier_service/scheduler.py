"""Which sequences run in the next forward, with how many tokens and how many drafts.

Running sequences decode first (1 pending token + k drafts each, k and the leaves from
the speculation plan, verifier_service/speculation); the rest of the token budget goes to
prefill chunks. The scheduler fits the plan into the KV pool and the token budget.
The scheduler owns every KV reservation: admission reserves blocks for the prompt +
(k + 1); a decode slot reserves 1 + k + its alternatives (when blocks run short the
alternatives go first, then k is lowered; if even k = 0 does not fit, the newest running
sequence is preempted: its blocks freed, recomputed later). It returns a plan that
nothing after it changes.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import replace

from specd.config import EngineConfig
from specd.kvcache import BlockAllocator, NoFreeBlocks
from verifier_service.records import Slot, StepPlan
from verifier_service.sequence import Sequence


def prefill_target(seq: Sequence) -> int:
    """Tokens to cache before decoding: all of a fresh prompt (its last position's logits
    give the first token); all but the pending token once tokens were generated."""
    return len(seq.tokens) - (0 if seq.prefilling else 1)


class Scheduler:
    def __init__(self, allocator: BlockAllocator, config: EngineConfig, rows_alone: bool = False):
        """`rows_alone`: a row's numbers in the forward depend on nothing but its own
        inputs and its sequence's cache, whatever else the forward holds (the model is
        chunk-invariant: integer kernels, paged attention; specd.models.llama). Then
        batch-invariant steps need not keep prefill and decode apart."""
        if config.max_batched_tokens <= 0:  # auto is the engine's to resolve
            raise ValueError("the scheduler needs max_batched_tokens resolved (batched_tokens)")
        self.allocator = allocator
        self.config = config
        # batch-invariant decoding without such rows: a decode step holds no prefill rows
        # (whose forward takes other kernels), so a prompt that joins stalls the batch for
        # a whole forward (~40 ms for a cached prompt's last token at c = 4 on the 2-core CPU)
        self.separate_prefill = config.batch_invariant and not rows_alone
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0  # sequences preempted since start (each time counted)
        self._last_was_prefill = False

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

    def ready(self) -> list[Sequence]:
        """The running sequences that decode this step (their prompt is cached)."""
        return [s for s in self.running if s.num_cached >= prefill_target(s)]

    @property
    def batch(self) -> int:
        """Sequences running and waiting."""
        return len(self.running) + len(self.waiting)

    def schedule(self, ready: list[Sequence], plan: StepPlan) -> tuple[Slot, ...]:
        """The step: `ready` (as `ready()` gave them) decode as `plan` decided for them,
        within the KV pool and the token budget, then prefill chunks."""
        budget = self.config.max_batched_tokens
        decode = self._schedule_decode(budget, ready, plan)
        budget -= sum(1 + s.k for s in decode)
        if self.separate_prefill and decode:
            # decode/verification forwards must not mix with prefill (different kernels);
            # alternate when both are waiting so neither starves, and decode whenever no
            # prefill can be scheduled (e.g. the batch is full)
            if self._wants_prefill() and not self._last_was_prefill:
                prefill = self._schedule_prefill(self.config.max_batched_tokens)
                if prefill:
                    self._last_was_prefill = True
                    return tuple(prefill)
            self._last_was_prefill = False
            return tuple(decode)
        prefill = self._schedule_prefill(budget)
        self._last_was_prefill = bool(prefill) and not decode
        if prefill:  # a step with prefill rows is past the size where leaves come free
            decode = [replace(s, alts=0) for s in decode]
        return tuple(decode + prefill)

    def _wants_prefill(self) -> bool:
        return bool(self.waiting) or any(s.num_cached < prefill_target(s) for s in self.running)

    def _schedule_decode(self, budget: int, ready: list[Sequence], plan: StepPlan) -> list[Slot]:
        room = plan.leaves
        slots = []
        for seq, decision in zip(ready, plan.decisions, strict=True):
            if seq not in self.running:
                continue  # preempted by an earlier sequence's reservation
            k = max(0, min(decision.k, budget - 1))
            leaves = min(k, room)  # at most one leaf beside each draft
            fit = self._fit(seq, k, leaves)
            if fit is None:
                continue
            k, alts = fit
            room -= alts
            budget -= 1 + k
            slots.append(Slot(seq, (seq.tokens[-1],), True, k, alts, True, decision))
            if budget <= 0:
                break
        return slots

    def _fit(self, seq: Sequence, k: int, alts: int) -> tuple[int, int] | None:
        """Reserve blocks for 1 + k + alts new tokens: without the alternatives, then
        lowering k, then preempting others. -> (k, alts) reserved, None if preempted."""
        tries = [(k, alts)] + [(kk, 0) for kk in range(k, -1, -1)]
        while True:
            for kk, aa in tries:
                try:
                    self.allocator.reserve(seq.seq_id, seq.num_cached + 1 + kk + aa)
                    return kk, aa
                except NoFreeBlocks:
                    continue
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return None

    def _preempt(self, seq: Sequence) -> None:
        self.preemptions += 1
        self.running.remove(seq)
        self.allocator.free(seq.seq_id)
        seq.num_cached = 0
        self.waiting.appendleft(seq)

    def _schedule_prefill(self, budget: int) -> list[Slot]:
        slots = []
        for seq in self.running:  # chunked prefills already admitted
            if budget <= 0:
                break
            if seq.num_cached < prefill_target(seq):
                slots.append(self._chunk(seq, budget))
                budget -= len(slots[-1].tokens)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_batch_size:
            seq = self.waiting[0]
            k = max(seq.num_draft, seq.num_predicted)  # the most it may draft
            reuse = seq.tokens[: prefill_target(seq) - 1]  # at least one token to compute
            if seq.wants_prompt_rows:  # every prompt row is computed: none is reused
                reuse = []
            try:
                seq.num_cached = self.allocator.allocate(
                    seq.seq_id, len(seq.tokens) + k + 1, reuse, seq.cache_salt
                )
            except NoFreeBlocks:
                break
            if seq.prompt_hits is None:  # a preempted one comes back: its first count stands
                seq.prompt_hits = seq.num_cached
            self.waiting.popleft()
            self.running.append(seq)
            slots.append(self._chunk(seq, budget))
            budget -= len(slots[-1].tokens)
        return slots

    @staticmethod
    def _chunk(seq: Sequence, budget: int) -> Slot:
        seq.t_scheduled = seq.t_scheduled or time.time_ns()
        end = min(prefill_target(seq), seq.num_cached + budget)
        last = end == prefill_target(seq) and seq.prefilling
        tokens = tuple(seq.tokens[seq.num_cached : end])
        return Slot(seq, tokens, False, logits=last, prompt_rows=seq.wants_prompt_rows)
