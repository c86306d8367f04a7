"""The router's request path, whichever door a request came in by (gRPC or the OpenAI HTTP
API): validate, tokenize, decide, pick a replica, relay text deltas, cut at stop strings.

The doors only translate: a request arrives as a `GenerateRequest`, what went wrong leaves
as a `RequestError` carrying a gRPC status (the HTTP door maps it to an HTTP code)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

import grpc
from opentelemetry import trace

from protos.specd.v1 import common_pb2, router_pb2, verifier_pb2
from router.client import MODES
from router.detok import IncrementalDetokenizer, StopStrings
from router.policy import Decision, Load, Policy, PolicyFile, decide
from router.replicas import ReplicaSet
from specd.params import SamplingParams
from specd.telemetry import extract_metadata, inject_metadata
from specd.wire import constraint_from_proto, params_from_proto

log = logging.getLogger(__name__)
CLIENT_MODES = {proto: name for name, proto in MODES.items()}  # the request's override
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED}
# the roles of the chat format every HF chat template is written for; a template that
# cannot render one of them raises, and that is refused too (see _tokenize)
ROLES = frozenset({"system", "user", "assistant", "tool"})


class RequestError(Exception):
    """A request that ends with a status: `retry_after_ms` is the hint a verifier sent with
    RESOURCE_EXHAUSTED (0: none)."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_ms: int = 0):
        super().__init__(message)
        self.code = code
        self.retry_after_ms = retry_after_ms

    @classmethod
    def from_rpc(cls, exc: grpc.aio.AioRpcError) -> RequestError:
        hint = dict(exc.trailing_metadata() or ()).get("retry-after-ms", "0")
        retry = int(hint) if str(hint).isdigit() else 0
        return cls(exc.code(), exc.details() or str(exc.code()), retry)


@dataclass
class Prepared:
    """A validated request: what every attempt on a replica sends."""

    request: router_pb2.GenerateRequest
    params: SamplingParams  # request.params, checked
    prompt_ids: list[int]
    route: str
    warnings: list[str]
    policy: object
    max_new_tokens: int
    metadata: Mapping[str, str]  # the caller's gRPC metadata or HTTP headers (lower case)
    deadline: float | None  # time.monotonic() past which the request fails


class Router:
    def __init__(
        self,
        tokenizer,
        replicas: ReplicaSet,
        policy: Policy,
        default_max_new_tokens: int = 256,
        max_new_tokens_cap: int = 4096,
        telemetry=None,
    ):
        self.metrics = RouterMetrics(telemetry) if telemetry is not None else None
        self.tracer = telemetry.tracer if telemetry is not None and telemetry.tracing else None
        self.tokenizer = tokenizer
        self.replicas = replicas
        self.policy = policy
        self.default_max_new_tokens = default_max_new_tokens
        self.max_new_tokens_cap = max_new_tokens_cap

    # -- the request's life ------------------------------------------------------------------
    async def generate(self, prep: Prepared) -> router_pb2.GenerateResponse:
        """The whole completion (nothing is sent before the end, so a replica lost midway
        is retried elsewhere from the start)."""
        text, ids, final = [], [], None
        async for msg in self.stream(prep, buffered=True):
            text.append(msg.text)
            ids.extend(msg.token_ids)
            final = msg
        return router_pb2.GenerateResponse(
            text="".join(text),
            token_ids=ids,
            finish_reason=final.finish_reason,
            usage=final.usage,
            speculation=final.speculation,
            route=final.route,
            warnings=final.warnings,
        )

    async def stream(
        self, prep: Prepared, buffered: bool = False
    ) -> AsyncIterator[router_pb2.GenerateStreamResponse]:
        """The request's messages; the last carries finish_reason, usage and speculation.
        `buffered`: the caller sends nothing before the end, so a replica lost after tokens
        arrived is retried elsewhere too (a streamed request can only be retried before)."""
        if self.tracer is None and self.metrics is None:
            async for msg in self._attempts(prep, None, buffered):
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
        started, first, tokens, final = time.perf_counter(), None, 0, None
        try:
            async for msg in self._attempts(prep, span, buffered):
                if first is None and msg.token_ids:
                    first = time.perf_counter()
                tokens += len(msg.token_ids)
                final = msg if msg.finish_reason else final
                yield msg
        finally:
            if self.metrics is not None and final is not None:
                self.metrics.finished(prep.route, final, started, first, tokens)
            if span is not None:
                span.end()

    async def _attempts(self, prep: Prepared, span, buffered: bool):
        """The verifier's stream from the least-loaded replica; one that fails before it
        streamed anything is retried on the next (never one already tried)."""
        client = CLIENT_MODES.get(prep.request.speculation, "auto")
        tried: set[str] = set()
        last_error = None
        while True:
            replica = self.replicas.choose(exclude=tried)
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
                call = self._call(replica, prep, decision, span, buffered)
                async with contextlib.aclosing(call) as messages:  # its cleanup runs now
                    async for msg in messages:
                        started = True
                        yield msg
                return
            except grpc.aio.AioRpcError as exc:
                if exc.code() in RETRYABLE and not started:
                    log.warning("replica %s: %s; trying another", replica.address, exc.code())
                    last_error = exc
                    continue  # nothing streamed yet: safe to retry elsewhere
                raise RequestError.from_rpc(exc) from None

    async def _call(self, replica, prep: Prepared, decision, span, buffered: bool):
        """One Generate call on one replica, relayed (buffered: every message read before
        the first is handed on, so a failure mid-way can still be retried)."""
        call = replica.stub.Generate(
            _verifier_request(prep, decision),
            timeout=_remaining(prep.deadline),
            metadata=inject_metadata(trace.set_span_in_context(span)) if span else None,
        )
        replica.inflight += 1
        try:
            if buffered:
                for msg in [m async for m in self._relay(call, prep, decision)]:
                    yield msg
                return
            async for msg in self._relay(call, prep, decision):
                yield msg
        finally:
            replica.inflight -= 1
            replica.finished = time.monotonic()
            call.cancel()  # no-op when done; frees the verifier's KV when we stop early

    def _decide(self, prep: Prepared, client: str, temperature: float, replica, span):
        load = _load(replica)
        if span is None:
            decision = decide(prep.policy, client, temperature, load)
        else:
            ctx = trace.set_span_in_context(span)
            with self.tracer.start_as_current_span("specd.router.decide", context=ctx) as d:
                decision = decide(prep.policy, client, temperature, load)
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

    async def _relay(self, call, prep: Prepared, decision: Decision):
        detok = IncrementalDetokenizer(self.tokenizer)
        stops = StopStrings(list(prep.request.stop))
        ids: list[int] = []
        finish, spec, usage = "", common_pb2.SpeculationInfo(), common_pb2.Usage()
        async for resp in call:
            ids.extend(resp.token_ids)
            text = stops.feed(detok.push(list(resp.token_ids)))
            usage, finish = resp.usage, resp.finish_reason
            if resp.HasField("speculation"):
                spec = resp.speculation
            if stops.stopped:
                finish = "stop"
                usage = common_pb2.Usage(
                    prompt_tokens=len(prep.prompt_ids), completion_tokens=len(ids)
                )
                call.cancel()
            if finish:
                text += stops.flush()
                # the verifier's account is the truth; the arrival's rides beside it, and
                # stands in where the verifier had nothing to decide (or was cut off by a
                # stop string before its final report)
                spec.arrival_reason = decision.reason
                if spec.reason in ("", "off:request"):
                    spec.reason = decision.reason
                    spec.num_draft_tokens = decision.k
                yield router_pb2.GenerateStreamResponse(
                    text=text,
                    token_ids=resp.token_ids,
                    finish_reason=finish,
                    usage=usage,
                    speculation=spec,
                    route=prep.route,
                    warnings=prep.warnings,
                )
                return
            if text or resp.token_ids:
                yield router_pb2.GenerateStreamResponse(text=text, token_ids=resp.token_ids)

    # -- validation --------------------------------------------------------------------------
    def prepare(
        self,
        request: router_pb2.GenerateRequest,
        metadata: Mapping[str, str],
        timeout: float | None = None,
    ) -> Prepared:
        """Check the request and tokenize its input; raises RequestError(INVALID_ARGUMENT).
        `metadata`: lower-case keys (x-route, traceparent); `timeout`: seconds, or None."""
        which = request.WhichOneof("input")
        if which is None:
            raise _invalid("one of prompt, messages or token_ids is required")
        params = params_from_proto(request.params)
        try:
            params.validate()
            constraint = constraint_from_proto(request.constraint)
            if constraint is not None:
                constraint.grammar()  # compiled (and cached) here: a bad one never travels
        except ValueError as exc:
            raise _invalid(str(exc)) from None
        max_new = request.max_new_tokens or self.default_max_new_tokens
        if max_new < 0 or max_new > self.max_new_tokens_cap:
            raise _invalid(f"max_new_tokens must be in [1, {self.max_new_tokens_cap}]")
        ids = self._tokenize(request, which)
        if not ids:
            raise _invalid("the prompt is empty")
        route_name = request.route or metadata.get("x-route", "") or "default"
        policy_set = self.policy.current() if isinstance(self.policy, PolicyFile) else self.policy
        route, policy, warning = policy_set.for_route(route_name)
        deadline = None if timeout is None else time.monotonic() + timeout
        warnings = [warning] if warning else []
        return Prepared(request, params, ids, route, warnings, policy, max_new, metadata, deadline)

    def _tokenize(self, request, which: str) -> list[int]:
        if which == "token_ids":
            ids = list(request.token_ids.ids)
            vocab = len(self.tokenizer)
            if any(not 0 <= t < vocab for t in ids):
                raise _invalid(f"token ids must be in [0, {vocab})")
            return ids
        if which == "prompt":
            return list(self.tokenizer(request.prompt, add_special_tokens=False)["input_ids"])
        messages = [{"role": m.role, "content": m.content} for m in request.messages.messages]
        if not messages:
            return []
        for i, m in enumerate(messages):
            if m["role"] not in ROLES:
                raise _invalid(
                    f"messages[{i}].role {m['role']!r} is not one of {', '.join(sorted(ROLES))}"
                )
        try:
            enc = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True
            )
        except Exception as exc:  # the template rejects the conversation
            raise _invalid(f"chat template failed: {exc}") from None
        return list(enc["input_ids"] if hasattr(enc, "keys") else enc)


def _invalid(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


def _remaining(deadline: float | None) -> float | None:
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise RequestError(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed")
    return left


def _verifier_request(prep: Prepared, decision: Decision) -> verifier_pb2.VerifyGenerateRequest:
    request, policy = prep.request, prep.policy
    return verifier_pb2.VerifyGenerateRequest(
        prompt_ids=prep.prompt_ids,
        params=request.params,
        max_new_tokens=prep.max_new_tokens,
        ignore_eos=request.ignore_eos,
        constraint=request.constraint,
        num_draft_tokens=decision.k,
        route=prep.route,
        auto=decision.auto,
        # the route's soft bounds, applied by the verifier every step
        draft_below_batch=policy.max_batch_size if decision.auto else 0,
        max_kv_utilization=policy.max_kv_utilization if decision.auto else 0.0,
        min_acceptance=policy.min_acceptance if decision.auto else 0.0,
    )


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


class RouterMetrics:
    def __init__(self, telemetry):
        from specd import telemetry as names

        t = telemetry
        route = ("route",)
        self.requests = t.counter(names.REQUESTS, "Requests finished", ("route", "finish_reason"))
        self.decisions = t.counter(names.DECISIONS, "Speculation decisions", ("route", "reason"))
        self.tokens = t.counter(names.TOKENS_OUT, "Tokens generated", route)
        self.ttft = t.histogram(names.TTFT, "Time to first token", route)
        self.tpot = t.histogram(
            names.TPOT, "Time per output token after the first", ("route", "speculation")
        )
        self.e2e = t.histogram(names.E2E, "End-to-end request latency", route)

    def finished(self, route: str, final, started: float, first, tokens: int) -> None:
        now = time.perf_counter()
        self.requests.labels(route, final.finish_reason).inc()
        self.tokens.labels(route).inc(tokens)
        self.e2e.labels(route).observe(now - started)
        if first is not None:
            self.ttft.labels(route).observe(first - started)
            if tokens > 1:
                spec = "on" if final.speculation.enabled else "off"
                self.tpot.labels(route, spec).observe((now - first) / (tokens - 1))
