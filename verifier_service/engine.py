"""The verifier engine: continuous batching with speculative verification.

One step, each phase handing the next what it made and nothing going back:
  plan (speculation: who drafts, at which k, how many leaves; its `plan` door)
  -> schedule (scheduler.py: frozen slots fitting the plan, every KV reservation made)
  -> draft (drafting.py: proposals cut to the plan and to grammars)
  -> ONE batched target forward (query length k_i + 1 + leaves per decoding sequence,
     k_i = 0 is plain decode; prefill chunks ride along)
  -> verify (verify.py: a Verdict per sequence)
  -> commit (KV kept up to the accepted drafts; tokens and stop checks on the Sequence)
  -> observe (speculation: what the step did, through its `observe` door).
The records they hand on are in records.py. On a device whose forward returns queued (a
GPU's), the two speculation doors run while it computes: observe for the step before, and
the next step's plan ahead (`_while_computing`). The engine is synchronous; frontend.py
runs its steps for asyncio callers.
"""

from __future__ import annotations

import itertools
import logging
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

import torch
from opentelemetry import trace

from specd.config import EngineConfig, batched_tokens, chunk_invariant, prefix_cache_on
from specd.grammar import Grammars, GrammarState
from specd.models.paged_kv import PagedKV
from specd.proposal import Proposer
from verifier_service import logprobs
from verifier_service.drafting import draft_rounds, draft_state
from verifier_service.records import (
    Round,
    RoundReport,
    SeqView,
    Slot,
    StepPlan,
    StepReport,
    StepView,
)
from verifier_service.request import Request
from verifier_service.scheduler import Scheduler
from verifier_service.sequence import Sequence, SpecStats, StepOutput
from verifier_service.sizing import context_and_blocks, graph_rows
from verifier_service.speculation import SpeculationControl
from verifier_service.tree import moves
from verifier_service.verify import Verdict, verify_rounds

log = logging.getLogger(__name__)


@dataclass
class Priced:
    """Decode steps the speculation control priced and that ran as planned: the tokens and
    seconds it expected of them (tree leaves left out) and what they emitted and took.
    Their ratio is how far its prices and acceptance are from the machine's."""

    steps: int = 0
    expected_tokens: float = 0.0
    tokens: int = 0
    expected_seconds: float = 0.0
    seconds: float = 0.0

    def add(self, expected: tuple[float, float], tokens: int, seconds: float) -> None:
        self.steps += 1
        self.expected_tokens += expected[0]
        self.tokens += tokens
        self.expected_seconds += expected[1]
        self.seconds += seconds


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
    preemptions: int = 0  # sequences preempted for KV room (recomputed later), since start
    step_seconds: float = 0.0  # running steps, since start
    # in the speculation control's plan and observe where the step waits for them (not
    # while a queued device computes), since start
    control_seconds: float = 0.0
    # decode steps the speculation control priced, since start: what it expected of them
    # and what they did (`Priced`)
    priced: Priced = field(default_factory=Priced)

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
        load_tokenizer=None,
    ):
        self.model = model
        # constrained requests need the tokenizer (llguidance reads its tokens' bytes),
        # loaded at the first one
        vocab = model.args.vocab_size
        self.grammars = None if load_tokenizer is None else Grammars(load_tokenizer, vocab, eos_ids)
        config = config or EngineConfig()
        device = torch.device(model.device).type
        self.config = replace(config, max_batched_tokens=batched_tokens(config, device))
        self.context, num_blocks = context_and_blocks(model, self.config)
        bs = self.config.block_size
        if model.gpu is not None and not self.config.batch_invariant:
            model.gpu.tile = 0  # one GEMM a step: faster, a row's bits depend on the batch
        prefix_cache = prefix_cache_on(self.config.prefix_cache, model)
        self.kv = PagedKV.for_model(model, num_blocks, bs, prefix_cache)
        rows, graphs = graph_rows(self.config), not self.config.enforce_eager
        model.prepare_steps(self.kv, self.config.max_batch_size, rows, graphs)
        mib = PagedKV.bytes_per_block(model, bs) * num_blocks / 2**20
        log.info("KV cache: %d blocks of %d (%d tokens, %.0f MiB, %s); prefix cache %s",
                 num_blocks, bs, num_blocks * bs, mib, str(model.kv_dtype).removeprefix("torch."),
                 "on" if prefix_cache else "off")  # fmt: skip
        self.scheduler = Scheduler(self.kv.allocator, self.config, chunk_invariant(model))
        self._seeds = random.Random(config.seed) if config.seed >= 0 else None
        self.speculation = SpeculationControl(self.config)
        self.observed = self.speculation.observe(StepReport())  # what it has learned
        self._unobserved: StepReport | None = None  # a queued device's last step, to learn
        # seconds since start in steps, and in the speculation control's two doors where
        # the step waits for them: Python between the steps, whose share grows as a faster
        # device shortens them
        self.step_s, self.control_s = 0.0, 0.0
        self.priced: dict[int, Priced] = {}  # by the most drafts the step planned
        self._priced_total = Priced()
        self.proposer = proposer
        self.eos_ids = frozenset(eos_ids or ())
        self._ids = itertools.count()
        self._seqs: dict[int, Sequence] = {}
        self._aborts: list[int] = []
        self._resets: list[Future] = []  # reset_prefix_cache's, applied before a step
        self._lock = threading.Lock()
        self.totals = SpecStats()  # every round since start (for load reports and metrics)
        self.tree_rounds = self.branches_taken = 0  # rounds with alternatives; won by one
        self.tracer = telemetry.tracer if telemetry is not None and telemetry.tracing else None
        # called once in each step that runs the model, where the step's Python ends and
        # the thread goes to wait (on the drafter's round where the drafter catches up,
        # else on the forward: `_run_step`): frontend.py hands the last step's outputs on
        self.before_forward: Callable[[], None] | None = None

    # -- requests ----------------------------------------------------------------------------
    def add_request(self, request: Request, grammar: GrammarState | None = None) -> int:
        """Queue a request (ValueError when it cannot be served); -> its sequence id.
        `grammar`: its constraint's state, started already (`grammars.start`: compiling
        may take a while, best off the caller's event loop)."""
        args, alloc = self.model.args, self.kv.allocator
        # the request's k bounded by this engine's, once: admission reserves for it, and
        # the plan drafts within it (and the tokens left)
        cap = self.config.max_draft_tokens
        request = replace(request, num_draft=min(request.num_draft, cap))
        params = request.params
        if self._seeds is not None and params.seed is None and not params.greedy:
            request = replace(request, params=replace(params, seed=self._seeds.getrandbits(62)))
        need = alloc.blocks_for(len(request.prompt) + request.max_new_tokens + 1)
        request.validate(args.vocab_size, self.context, need, alloc.num_blocks)
        infill = None
        if (request.constraint is not None or request.params.infill) and self.grammars is None:
            raise ValueError(
                "this verifier was started without a tokenizer: no constraints, no infill"
            )
        if request.constraint is not None and grammar is None:
            grammar = self.grammars.start(request.constraint)
        if request.params.infill:
            infill = self.grammars.infill_filter()
        seq = Sequence.start(next(self._ids), request, self.eos_ids, grammar, infill)
        seq.drafter_window = getattr(self.proposer, "context_window", 0)
        if request.prediction and request.num_draft:  # its drafts cost no draft model
            seq.num_predicted = cap
        with self._lock:
            self._seqs[seq.seq_id] = seq
            self.scheduler.add(seq)
        return seq.seq_id

    def max_context(self) -> int:
        """The longest prompt + generation a request may ask for: the context (the
        model's, or --max-model-len), or what the KV pool holds (less the one slot
        admission adds) where that is less."""
        alloc = self.kv.allocator
        pool = alloc.num_blocks * alloc.block_size - 1
        return min(self.context, pool)

    def abort(self, seq_id: int) -> None:
        """Stop a request; its KV blocks (both caches) are freed before the next step."""
        with self._lock:
            self._aborts.append(seq_id)

    def reset_prefix_cache(self) -> Future:
        """Forget every cached prefix before the next step (on the model thread, between
        steps): -> a future of the blocks forgotten. Running requests keep their blocks."""
        future = Future()
        with self._lock:
            self._resets.append(future)
        return future

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._aborts) or bool(self._resets)

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
            preemptions=self.scheduler.preemptions,
            step_seconds=self.step_s,
            control_seconds=self.control_s,
            priced=replace(self._priced_total),
        )

    def acceptance_by_route(self) -> dict[str, float]:
        return self.observed.acceptance_by_route

    # -- one step ----------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        if self._resets:  # read without the lock: one added meanwhile waits for the next step
            self._apply_resets()
        return self._apply_aborts() + self._scheduled_step()

    def _scheduled_step(self) -> list[StepOutput]:
        ready, used = self.scheduler.ready(), self.kv.allocator.utilization()
        view = StepView(tuple(SeqView.of(s) for s in ready), self.scheduler.batch, used)
        t0 = time.perf_counter()
        decided = self.speculation.plan(view)
        self.control_s += time.perf_counter() - t0
        plan = self.scheduler.schedule(ready, decided)
        if not plan:
            return []
        before = self.step_s
        if self.tracer is None:
            outputs = self._run_step(plan)
        else:
            # one batch serves many requests: link the step span to theirs, never parent it
            links = [trace.Link(s.seq.span.get_span_context()) for s in plan if s.seq.span]
            with self.tracer.start_as_current_span("specd.engine.step", links=links) as span:
                span.set_attribute("specd.batch_size", len(plan))
                outputs = self._run_step(plan)
        if decided.expected is not None:
            self._count_priced(decided, plan, outputs, self.step_s - before)
        return outputs

    def _count_priced(self, decided: StepPlan, plan, outputs, seconds: float) -> None:
        """A priced step against what it did, where it ran as planned: every sequence
        decoding at the k planned (not cut for KV or tokens, no prefill beside it)."""
        ks = [d.k for d in decided.decisions]
        if [s.k for s in plan] != ks or not all(s.decode for s in plan):
            return
        tokens = sum(len(out.tokens) for out in outputs)
        for priced in (self.priced.setdefault(max(ks), Priced()), self._priced_total):
            priced.add(decided.expected, tokens, seconds)

    def _run_step(self, plan: tuple[Slot, ...]) -> list[StepOutput]:
        t0 = time.perf_counter()
        # the last step's outputs go to the event loop where this thread stops running
        # Python: before the drafter's round where the drafter catches up (on a prompt,
        # which a request's first token must not wait for), else before the forward. A
        # steady round may be no more than a gRPC round trip (drafts made ahead, a
        # lookup), which the event loop's work beside it slows (docs/benchmarks-log.md
        # section 87). A GPU's forward returns with its kernels queued (`model.queued`):
        # there they go after it, to run while the device computes
        catching_up = any(s.decode and s.k and s.seq.drafter_behind for s in plan)
        if catching_up:
            self._leaving_python()
        rounds = draft_rounds(plan, self.proposer, self.model.args.vocab_size)
        t1 = time.perf_counter()
        if not (catching_up or self.model.queued):
            self._leaving_python()
        logits = self._forward(rounds)
        if self.model.queued and not catching_up:
            self._leaving_python()
        if self.model.queued:
            self._while_computing(plan)
        self.model.synchronize()
        t2 = time.perf_counter()
        if any(r.slot.prompt_rows for r in rounds):
            rounds, logits = _read_prompt_rows(rounds, logits)
        sampling = [r for r in rounds if r.num_logits > 0]
        verdicts = verify_rounds(sampling, logits, self.model.args.vocab_size)
        reports = [_report(r, verdicts.get(r.slot.seq_id)) for r in rounds]  # before commit
        outputs = [self._commit(r, verdicts.get(r.slot.seq_id)) for r in rounds]
        self._prefetch(rounds)
        t3 = time.perf_counter()
        report = StepReport(tuple(reports), t1 - t0, t2 - t1, t3 - t0)
        if self.model.queued and self.scheduler.has_work():  # learned while the next computes
            self._unobserved = report
        else:
            self.observed = self.speculation.observe(report)
        self.step_s += report.step_s
        self.control_s += time.perf_counter() - t3
        return [out for out in outputs if out is not None]

    def _while_computing(self, plan: tuple[Slot, ...]) -> None:
        """A queued device's step computes: meanwhile the speculation control learns the
        step before it and plans the one after it, as this step's decoding sequences
        should then stand (those its tokens cannot finish, in order; the batch without
        those they will). The step's Python then has neither door to wait for (and
        `control_s` counts neither)."""
        if self._unobserved is not None:
            self.observed = self.speculation.observe(self._unobserved)
            self._unobserved = None
        decoding = [s for s in plan if s.decode]
        going = [s for s in decoding if s.seq.max_new_tokens - s.seq.num_generated > 1]
        ready = tuple(SeqView.of(s.seq).after(s.k) for s in going)
        batch = self.scheduler.batch - (len(decoding) - len(going))
        used = self.kv.allocator.utilization()
        self.speculation.plan_ahead(StepView(ready, batch, used))

    def _prefetch(self, rounds: list[Round]) -> None:
        """A remote n-gram drafter is asked for the next round of each sequence that
        drafted by a lookup and goes on, as soon as its tokens are committed
        (RemoteProposer.prefetch): the round trip then runs beside the rest of this step
        and the next one's plan."""
        if not getattr(self.proposer, "prefetches", False):  # checked first: every step
            return
        going = [draft_state(r.slot) for r in rounds if r.lookup and r.seq.finish_reason is None]
        if going:
            self.proposer.prefetch(going)

    def _leaving_python(self) -> None:
        if self.before_forward is not None:
            self.before_forward()

    def _forward(self, rounds: list[Round]) -> torch.Tensor:
        decode_only = all(r.slot.decode for r in rounds)
        self.model.batch_invariant = self.config.batch_invariant and decode_only
        return self.model.forward(self.kv, [r.seq_input() for r in rounds])

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
        if verdict.logprobs is not None:
            out.logprobs = verdict.logprobs[: len(new)]
        out.prompt_logprobs = seq.take_prompt_logprobs()
        out.lookup = r.lookup
        out.prompt_hits = seq.prompt_hits or 0
        out.decision = (r.slot.decision.reason, r.slot.decision.gain)
        # the account so far, as of this output (a router that cuts the request at a stop
        # string keeps the last it got)
        out.stats = replace(
            seq.stats, reason=seq.speculation.reason(seq.decisions, seq.stats.rounds)
        )
        if seq.finish_reason:
            out.stop_token, out.error = seq.stopped_at_token, seq.error
            out.timing = (seq.t_arrived, seq.t_scheduled, seq.t_first_token, time.time_ns())
        return out

    def _account(self, r: Round, accepted: int) -> None:
        """The round's counts: on the sequence and in the totals (the speculation control
        learns them from the step's report)."""
        seq, k = r.seq, r.k
        if r.slot.decode:
            seq.decided(r.slot.decision.reason, r.slot.k)
        seq.stats.record(k, accepted, r.lookup, r.predicted)
        self.totals.record(k, accepted, r.lookup, r.predicted)
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

    def _apply_resets(self) -> None:
        with self._lock:
            resets, self._resets = self._resets, []
        if resets:
            forgotten = self.kv.allocator.forget_cached()
            if self.proposer is not None:
                self.proposer.forget_cached()
            for future in resets:
                future.set_result(forgotten)

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


def _read_prompt_rows(rounds: list[Round], logits: torch.Tensor):
    """The step's prefill chunks that computed a row for every token: the prompt's
    log-probabilities read off those rows onto their sequences; -> the rounds and logits
    as verification reads them (each round's sampling row only)."""
    kept_rounds, kept_rows, offset = [], [], 0
    for r in rounds:
        rows = logits[offset : offset + r.num_logits]
        offset += r.num_logits
        if r.slot.prompt_rows:
            logprobs.prompt_rows(r.seq, rows, r.seq.num_cached)
            r = replace(r, slot=replace(r.slot, prompt_rows=False))
            rows = rows[len(rows) - r.num_logits :]
        kept_rounds.append(r)
        kept_rows.append(rows)
    return kept_rounds, torch.cat(kept_rows)


def _report(r: Round, verdict: Verdict | None) -> RoundReport:
    """A round as the speculation control learns it (read before the commit moves the
    sequence on: `behind` is what the drafter caught up on for this round)."""
    return RoundReport(
        seq_id=r.slot.seq_id,
        route=r.seq.speculation.acceptance_key(r.predicted),
        decode=r.slot.decode,
        planned=r.slot.k,
        drafted=r.k,
        accepted=None if verdict is None else verdict.accepted,
        proposed=r.proposal is not None,
        ngram=r.lookup,
        rows=r.num_logits,
        behind=r.seq.drafter_behind,
    )
