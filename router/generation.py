"""The router's request path, whichever door a request came in by (gRPC or the OpenAI HTTP
API): validate, tokenize, decide, pick a replica, relay text deltas, cut at stop strings.

The doors only translate: a request arrives as a `GenerateRequest`, what went wrong leaves
as a `RequestError` carrying a gRPC status (the HTTP door maps it to an HTTP code)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import grpc
from opentelemetry import trace

from protos.specd.v1 import router_pb2
from router.affinity import chunk_keys
from router.client import MODES
from router.decide import Load, decide
from router.metrics import RequestClock, RouterMetrics
from router.policy import Policy
from router.prepare import Prepared, Preparer, RequestError
from router.relay import attempt
from router.replicas import ReplicaSet
from specd.telemetry import extract_metadata

log = logging.getLogger(__name__)
CLIENT_MODES = {proto: name for name, proto in MODES.items()}  # the request's override
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED}


class Router:
    def __init__(
        self,
        tokenizer,
        replicas: ReplicaSet,
        policy: Policy,
        default_max_new_tokens: int = 256,
        max_new_tokens_cap: int = 0,
        telemetry=None,
        model_name: str = "",
    ):
        """`model_name`: the served model's name, on the metrics under vLLM's names."""
        self.metrics = (
            RouterMetrics(telemetry, model_name, replicas) if telemetry is not None else None
        )
        self.tracer = telemetry.tracer if telemetry is not None and telemetry.tracing else None
        self.tokenizer = tokenizer
        self.replicas = replicas
        if self.metrics is not None:
            replicas.on_choice = self.metrics.chosen
        self.preparer = Preparer(tokenizer, policy, default_max_new_tokens, max_new_tokens_cap)
        # each door checks and tokenizes a request once (router/prepare.py)
        self.prepare = self.preparer.prepare

    # -- the request's life ------------------------------------------------------------------
    async def generate(self, prep: Prepared) -> router_pb2.GenerateResponse:
        """The whole completion (nothing is sent before the end, so a replica lost midway
        is retried elsewhere from the start)."""
        text, ids, logprobs, prompt_logprobs, final = [], [], [], [], None
        async for msg in self.stream(prep, buffered=True):
            text.append(msg.text)
            ids.extend(msg.token_ids)
            logprobs.extend(msg.logprobs)
            prompt_logprobs.extend(msg.prompt_logprobs)
            final = msg
        response = router_pb2.GenerateResponse(
            text="".join(text),
            token_ids=ids,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            finish_reason=final.finish_reason,
            usage=final.usage,
            speculation=final.speculation,
            route=final.route,
            warnings=final.warnings,
        )
        if (reason := final.WhichOneof("stop_reason")) is not None:
            setattr(response, reason, getattr(final, reason))
        return response

    async def stream(
        self, prep: Prepared, buffered: bool = False
    ) -> AsyncIterator[router_pb2.GenerateStreamResponse]:
        """The request's messages; the last carries finish_reason, usage and speculation.
        `buffered`: the caller sends nothing before the end, so a replica lost after tokens
        arrived is retried elsewhere too (a streamed request can only be retried before)."""
        if self.tracer is None and self.metrics is None:
            async for _, msg in self._attempts(prep, None, buffered):
                yield msg
            return
        span = None
        if self.tracer is not None:
            span = self.tracer.start_span(
                "specd.router.generate",
                context=extract_metadata(prep.metadata.items()),
                kind=trace.SpanKind.SERVER,
                attributes={"specd.route": prep.route},
            )
        clock, final = RequestClock(), None
        try:
            async for arrived, msg in self._attempts(prep, span, buffered):
                clock.arrived(arrived, len(msg.token_ids))
                final = msg if msg.finish_reason else final
                yield msg
        finally:
            if self.metrics is not None and final is not None:
                self.metrics.finished(prep.route, final, clock)
            if span is not None:
                span.end()

    async def _attempts(self, prep: Prepared, span, buffered: bool):
        """The verifier's stream from the least-loaded replica, each message with its
        arrival time; one that fails before it streamed anything is retried on the next
        (never one already tried)."""
        client = CLIENT_MODES.get(prep.request.speculation, "auto")
        tried: set[str] = set()
        last_error = None
        keys = []  # the prompt's chunks, to find where it may be cached
        if self.replicas.affinity is not None:
            keys = chunk_keys(prep.prompt_ids, prep.request.cache_salt)
        while True:
            replica = self.replicas.choose(tried, keys)
            if replica is None and last_error is not None:  # every replica refused
                raise RequestError.from_rpc(last_error)
            if replica is None:
                raise RequestError(
                    grpc.StatusCode.UNAVAILABLE, "no healthy verifier replica; retry later"
                )
            tried.add(replica.address)
            decision = self._decide(prep, client, prep.params.temperature, replica, span)
            started = False  # once a message went to the client, no retry
            try:
                call = attempt(replica, prep, decision, span, buffered, self.tokenizer)
                async with contextlib.aclosing(call) as messages:  # its cleanup runs now
                    async for arrived, msg in messages:
                        started = True
                        yield arrived, msg
                return
            except grpc.aio.AioRpcError as exc:
                if exc.code() in RETRYABLE and not started:
                    log.warning("replica %s: %s; trying another", replica.address, exc.code())
                    last_error = exc
                    continue  # nothing streamed yet: safe to retry elsewhere
                raise RequestError.from_rpc(exc) from None

    def _decide(self, prep: Prepared, client: str, temperature: float, replica, span):
        load, predicted = _load(replica), bool(prep.prediction_ids)
        if span is None:
            decision = decide(prep.policy, client, temperature, load, predicted)
        else:
            ctx = trace.set_span_in_context(span)
            with self.tracer.start_as_current_span("specd.router.decide", context=ctx) as d:
                decision = decide(prep.policy, client, temperature, load, predicted)
                d.set_attributes(
                    {
                        "specd.route": prep.route,
                        "specd.speculation.reason": decision.reason,
                        "specd.k": decision.k,
                        "specd.replica": replica.address,
                    }
                )
            span.set_attribute("specd.speculation.arrival_reason", decision.reason)
        if self.metrics is not None:
            self.metrics.decisions.labels(prep.route, decision.reason).inc()
        return decision


def _load(replica) -> Load:
    """The chosen replica's load at arrival."""
    r = replica.report
    if r is None:
        return Load()
    util = r.kv_blocks_used / r.kv_blocks_total if r.kv_blocks_total else 0.0
    return Load(
        running=max(r.running + r.waiting, replica.inflight),
        kv_utilization=util,
        drafter_available=r.drafter_available,
    )


async def side_by_side(coroutines: list) -> list:
    """The coroutines' results, run side by side (a door's choices or prompts); the first
    refused (RequestError) cancels the others, which frees their KV, and is raised."""
    if len(coroutines) == 1:
        return [await coroutines[0]]
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(c) for c in coroutines]
    except ExceptionGroup as failed:
        refusals = [e for e in failed.exceptions if isinstance(e, RequestError)]
        if refusals:
            raise refusals[0] from None
        raise
    return [task.result() for task in tasks]
