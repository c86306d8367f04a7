"""The verifier's gRPC servicer: thin; validation and protobuf conversion at the edge."""

from __future__ import annotations

import asyncio
import logging

import grpc
from opentelemetry import trace

from protos.specd.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from specd.context_limit import ContextExceeded
from specd.telemetry import extract_metadata
from specd.wire import (
    ERROR_CODE_KEY,
    UNTIL_CONTEXT,
    constraint_from_proto,
    params_from_proto,
    speculation_to_proto,
)
from verifier_service.load import TokenRate, VerifierMetrics
from verifier_service.request import Request, SpeculationBounds

log = logging.getLogger(__name__)
RETRY_AFTER_MS = 500  # the hint sent with RESOURCE_EXHAUSTED


class VerifierServicer(verifier_pb2_grpc.VerifierServicer):
    def __init__(self, frontend, model_name: str, max_queue: int = 256, telemetry=None):
        """`frontend`: the engine for asyncio callers (verifier_service.frontend's
        AsyncEngine); the servicer reads the engine behind it for load and info."""
        self.frontend = frontend
        self.engine = frontend.engine
        self.model_name = model_name
        self.max_queue = max_queue
        self.rate = TokenRate()
        self.requests_started = 0  # Generate calls admitted (tests and debugging)
        self.draining = asyncio.Event()  # set on SIGTERM: load watches end
        self.metrics = VerifierMetrics(telemetry, self) if telemetry is not None else None
        self.stats_log = None  # a StatsLog, where the log says what the verifier does
        self.tracer = telemetry.tracer if telemetry is not None and telemetry.tracing else None

    async def close(self) -> None:
        """Stop the engine's step loop."""
        await self.frontend.close()

    def _drafter_available(self) -> bool:
        proposer = self.engine.proposer
        return proposer is not None and proposer.available

    async def Generate(self, request, context):
        if self.engine.load().waiting >= self.max_queue:
            context.set_trailing_metadata((("retry-after-ms", str(RETRY_AFTER_MS)),))
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"verifier queue is full ({self.max_queue} waiting); retry later or on "
                "another replica",
            )
        k = max(0, request.num_draft_tokens)  # the engine bounds it by its max_draft_tokens
        route = request.route or "default"
        self.requests_started += 1
        span = None
        if self.tracer is not None:
            parent = extract_metadata(context.invocation_metadata())
            span = self.tracer.start_span(
                "specd.verifier.generate",
                context=parent,
                attributes={"specd.route": route, "specd.k": k},
            )
        try:
            async for msg in self._generate(request, context, route, k, span):
                yield msg
        finally:
            if span is not None:
                span.end()

    async def _generate(self, request, context, route: str, k: int, span):
        try:
            constraint = constraint_from_proto(request.constraint)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        max_new = request.max_new_tokens
        if max_new == UNTIL_CONTEXT:  # at least 1: a prompt that fills the context is refused
            max_new = max(self.engine.max_context() - len(request.prompt_ids), 1)
        stream = self.frontend.generate_batches(
            _request(request, route, k, max_new, constraint, span)
        )
        try:
            try:
                outputs = await anext(stream)
            except ValueError as exc:
                if isinstance(exc, ContextExceeded):  # the door answers it in OpenAI's code
                    context.set_trailing_metadata(((ERROR_CODE_KEY, exc.code),))
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            generated = 0
            while True:
                last = outputs[-1]
                if last.finish_reason == "error" and last.error:  # the request's own fault
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, last.error)
                if last.finish_reason == "error":
                    await context.abort(
                        grpc.StatusCode.INTERNAL,
                        "the engine failed a step; "
                        "the request was dropped (see the verifier's log)",
                    )
                generated += sum(len(out.tokens) for out in outputs)
                yield self._response(request, route, k, outputs, generated, span)
                if last.finish_reason:
                    return
                outputs = await anext(stream)
        finally:
            await stream.aclose()  # a cancelled call frees the sequence's KV now

    def _response(self, request, route: str, k: int, outputs, generated: int, span):
        """One message for the steps' outputs that arrived together (their tokens in
        order); the metrics count each step."""
        tokens, logprobs, prompt_logprobs = [], [], []
        for out in outputs:
            tokens += out.tokens
            logprobs += out.logprobs or []
            prompt_logprobs += out.prompt_logprobs or []
            if self.metrics is not None:
                self.metrics.step(route, out)
        self.rate.add(len(tokens))
        if self.stats_log is not None:  # with the first token, the prompt's tokens
            first = tokens and generated == len(tokens)
            self.stats_log.add(outputs, len(request.prompt_ids) if first else 0)
        last = outputs[-1]
        msg = verifier_pb2.VerifyGenerateResponse(
            token_ids=tokens,
            finish_reason=last.finish_reason or "",
            usage=common_pb2.Usage(
                prompt_tokens=len(request.prompt_ids),
                completion_tokens=generated,
                cached_prompt_tokens=last.prompt_hits,
            ),
            logprobs=[common_pb2.TokenLogprob(**lp._asdict()) for lp in logprobs],
            prompt_logprobs=[common_pb2.TokenLogprob(**lp._asdict()) for lp in prompt_logprobs],
            stop_token=last.stop_token,
        )
        if last.stats is not None:  # so far; final on the last message
            msg.speculation.CopyFrom(speculation_to_proto(last.stats, k))
            if last.finish_reason and self.metrics is not None:
                self.metrics.finished(route, last.timing)
            if last.finish_reason and span is not None:
                self._phase_spans(span, last.stats, last.timing)
        return msg

    def _phase_spans(self, span, stats, timing) -> None:
        """Queueing and prefill as child spans, from the engine's timestamps."""
        arrived, scheduled, first, _ = timing
        ctx = trace.set_span_in_context(span)
        if scheduled:
            self.tracer.start_span("specd.verifier.queue", context=ctx, start_time=arrived).end(
                end_time=scheduled
            )
        if scheduled and first:
            self.tracer.start_span("specd.verifier.prefill", context=ctx, start_time=scheduled).end(
                end_time=first
            )
        span.set_attributes(
            {
                "specd.speculation.rounds": stats.rounds,
                "specd.speculation.drafted": stats.drafted,
                "specd.speculation.accepted": stats.accepted,
            }
        )

    async def WatchLoad(self, request, context):
        interval = (request.interval_ms or 100) / 1000
        while not context.cancelled() and not self.draining.is_set():
            yield self.load_report()
            await asyncio.sleep(interval)  # draining ends the watch: the router stops sending

    def load_report(self) -> verifier_pb2.LoadReport:
        load = self.engine.load()
        return verifier_pb2.LoadReport(
            kv_blocks_total=load.kv_blocks_total,
            kv_blocks_used=load.kv_blocks_used,
            running=load.running,
            waiting=load.waiting,
            spec_running=load.spec_running,
            tokens_per_s=self.rate.rate(),
            acceptance_by_route=self.engine.acceptance_by_route(),
            drafter_available=self._drafter_available(),
            kv_block_size=self.engine.kv.allocator.block_size,
            max_batch_size=self.engine.config.max_batch_size,
        )

    async def Info(self, request, context):
        args = self.engine.model.args
        return verifier_pb2.InfoResponse(
            model=self.model_name,
            vocab_size=args.vocab_size,
            max_context=self.engine.max_context(),
            eos_ids=sorted(self.engine.eos_ids),
            max_draft_tokens=self.engine.config.max_draft_tokens,
            drafter=getattr(self.engine.proposer, "drafter", ""),
        )

    async def ResetPrefixCache(self, request, context):
        blocks = await self.frontend.reset_prefix_cache()
        log.info("prefix cache reset: %d cached blocks forgotten", blocks)
        return verifier_pb2.ResetPrefixCacheResponse(blocks=blocks)


def _request(request, route: str, k: int, max_new: int, constraint, span) -> Request:
    auto = request.auto  # the route's bounds bind `auto` requests (a forced k drafts anyway)
    bounds = SpeculationBounds(
        auto=auto,
        route=route,
        draft_below_batch=request.draft_below_batch,
        max_kv_utilization=request.max_kv_utilization if auto else 1.0,
        min_acceptance=request.min_acceptance if auto else 0.0,
        proposer=request.proposer,
        suffix_private=request.suffix_private,
    )
    return Request(
        list(request.prompt_ids),
        params_from_proto(request.params),
        max_new_tokens=max_new,
        num_draft=k,
        stop_ids=frozenset(request.stop_ids),
        ignore_eos=request.ignore_eos,
        speculation=bounds,
        constraint=constraint,
        span=span,
        cache_salt=request.cache_salt,
        prediction=tuple(request.prediction_ids),
    )
