"""The public `Generation` service: validate, tokenize, decide, pick a replica, stream."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc
from opentelemetry import trace

from protos.specd.v1 import common_pb2, router_pb2, router_pb2_grpc, verifier_pb2
from router.detok import IncrementalDetokenizer, StopStrings
from router.policy import Decision, Load, Policy, PolicyError, PolicyFile, decide
from router.replicas import ReplicaSet
from specd.telemetry import extract_metadata, inject_metadata
from specd.wire import params_from_proto

log = logging.getLogger(__name__)
CLIENT_MODES = {
    router_pb2.SPECULATION_AUTO: "auto",
    router_pb2.SPECULATION_ON: "on",
    router_pb2.SPECULATION_OFF: "off",
}
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED}


class RequestError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


@dataclass
class Prepared:
    prompt_ids: list[int]
    route: str
    warnings: list[str]
    policy: object
    max_new_tokens: int


class GenerationServicer(router_pb2_grpc.GenerationServicer):
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

    async def Generate(self, request, context):
        text, ids, final = [], [], None
        async for msg in self._stream(request, context, buffered=True):
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

    async def GenerateStream(self, request, context):
        async for msg in self._stream(request, context):
            yield msg

    # -- the request's life ------------------------------------------------------------------
    async def _stream(self, request, context, buffered: bool = False):
        """The request's messages. `buffered`: the caller sends nothing before the end
        (unary Generate), so a replica lost mid-generation is retried elsewhere from the
        start, as one that failed before its first token always is."""
        try:
            prep = self._prepare(request, context)
        except RequestError as exc:
            await context.abort(exc.code, str(exc))
        if self.tracer is None and self.metrics is None:
            async for msg in self._attempts(request, context, prep, None, buffered):
                yield msg
            return
        span = None
        if self.tracer is not None:
            parent = extract_metadata(context.invocation_metadata())
            span = self.tracer.start_span(
                "specd.router.generate",
                context=parent,
                kind=trace.SpanKind.SERVER,
                attributes={"specd.route": prep.route},
            )
        started, first, tokens, final = time.perf_counter(), None, 0, None
        try:
            async for msg in self._attempts(request, context, prep, span, buffered):
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

    async def _attempts(self, request, context, prep: Prepared, span, buffered: bool):
        params = params_from_proto(request.params)
        client = CLIENT_MODES.get(request.speculation, "auto")
        tried: set[str] = set()
        last_error = None
        while True:
            replica = self.replicas.choose(exclude=tried)
            if replica is None and last_error is not None:  # every replica refused
                context.set_trailing_metadata(last_error.trailing_metadata() or ())
                await context.abort(last_error.code(), last_error.details())
            if replica is None:
                await context.abort(
                    grpc.StatusCode.UNAVAILABLE, "no healthy verifier replica; retry later"
                )
            tried.add(replica.address)
            decision = self._decide(prep, client, params.temperature, replica, span)
            policy = prep.policy
            call = replica.stub.Generate(
                verifier_pb2.VerifyGenerateRequest(
                    prompt_ids=prep.prompt_ids,
                    params=request.params,
                    max_new_tokens=prep.max_new_tokens,
                    ignore_eos=request.ignore_eos,
                    num_draft_tokens=decision.k,
                    route=prep.route,
                    auto=decision.auto,
                    # the route's soft bounds, applied by the verifier every step
                    draft_below_batch=policy.max_batch_size if decision.auto else 0,
                    max_kv_utilization=policy.max_kv_utilization if decision.auto else 0.0,
                    min_acceptance=policy.min_acceptance if decision.auto else 0.0,
                ),
                timeout=context.time_remaining(),
                metadata=inject_metadata(trace.set_span_in_context(span)) if span else None,
            )
            replica.inflight += 1
            started = False
            try:
                if buffered:
                    messages = [m async for m in self._relay(call, request, prep, decision)]
                    for msg in messages:
                        yield msg
                    return
                async for msg in self._relay(call, request, prep, decision):
                    started = True
                    yield msg
                return
            except grpc.aio.AioRpcError as exc:
                if exc.code() in RETRYABLE and not started:
                    log.warning("replica %s: %s; trying another", replica.address, exc.code())
                    last_error = exc
                    continue  # nothing streamed yet: safe to retry elsewhere
                await context.abort(exc.code(), exc.details() or str(exc.code()))
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
            self.metrics.decisions.add(1, {"route": prep.route, "reason": decision.reason})
        return decision

    async def _relay(self, call, request, prep: Prepared, decision: Decision):
        detok = IncrementalDetokenizer(self.tokenizer)
        stops = StopStrings(list(request.stop))
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

    def _prepare(self, request, context) -> Prepared:
        which = request.WhichOneof("input")
        if which is None:
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT, "one of prompt, messages or token_ids is required"
            )
        p = request.params
        try:
            params_from_proto(p).validate()
        except ValueError as exc:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        max_new = request.max_new_tokens or self.default_max_new_tokens
        if max_new < 0 or max_new > self.max_new_tokens_cap:
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"max_new_tokens must be in [1, {self.max_new_tokens_cap}]",
            )
        ids = self._tokenize(request, which)
        if not ids:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "the prompt is empty")
        metadata = dict(context.invocation_metadata() or ())
        route_name = request.route or metadata.get("x-route", "") or "default"
        policy_set = self.policy.current() if isinstance(self.policy, PolicyFile) else self.policy
        route, policy, warning = policy_set.for_route(route_name)
        return Prepared(ids, route, [warning] if warning else [], policy, max_new)

    def _tokenize(self, request, which: str) -> list[int]:
        if which == "token_ids":
            ids = list(request.token_ids.ids)
            vocab = len(self.tokenizer)
            if any(not 0 <= t < vocab for t in ids):
                raise RequestError(
                    grpc.StatusCode.INVALID_ARGUMENT, f"token ids must be in [0, {vocab})"
                )
            return ids
        if which == "prompt":
            return list(self.tokenizer(request.prompt, add_special_tokens=False)["input_ids"])
        messages = [{"role": m.role, "content": m.content} for m in request.messages.messages]
        if not messages:
            return []
        for i, m in enumerate(messages):
            if m["role"] not in ROLES:
                raise RequestError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"messages[{i}].role {m['role']!r} is not one of {', '.join(sorted(ROLES))}",
                )
        try:
            enc = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True
            )
        except Exception as exc:  # the template rejects the conversation
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT, f"chat template failed: {exc}"
            ) from None
        return list(enc["input_ids"] if hasattr(enc, "keys") else enc)


# the roles of the chat format every HF chat template is written for; a template that
# cannot render one of them raises, and that is refused too (see _tokenize)
ROLES = frozenset({"system", "user", "assistant", "tool"})


class RouterMetrics:
    def __init__(self, telemetry):
        from specd import telemetry as names

        t = telemetry
        self.requests = t.counter(names.REQUESTS, "Requests finished")
        self.decisions = t.counter(names.DECISIONS, "Speculation decisions")
        self.tokens = t.counter(names.TOKENS_OUT, "Tokens generated")
        self.ttft = t.histogram(names.TTFT, description="Time to first token")
        self.tpot = t.histogram(names.TPOT, description="Time per output token after the first")
        self.e2e = t.histogram(names.E2E, description="End-to-end request latency")

    def finished(self, route: str, final, started: float, first, tokens: int) -> None:
        now = time.perf_counter()
        labels = {"route": route}
        self.requests.add(1, {"route": route, "finish_reason": final.finish_reason})
        self.tokens.add(tokens, labels)
        self.e2e.record(now - started, labels)
        if first is not None:
            self.ttft.record(first - started, labels)
            if tokens > 1:
                spec = "on" if final.speculation.enabled else "off"
                self.tpot.record(
                    (now - first) / (tokens - 1), {"route": route, "speculation": spec}
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


GENERATION = router_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


async def _track_readiness(health, replicas: ReplicaSet) -> None:
    """`specd.v1.Generation` is SERVING only while some verifier replica is healthy (the
    readiness signal); the overall "" status stays SERVING while the process lives."""
    from grpc_health.v1 import health_pb2

    serving = health_pb2.HealthCheckResponse.SERVING
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    last = None
    while True:
        status = serving if replicas.any_healthy() else not_serving
        if status != last:
            await health.set(GENERATION, status)
            last = status
        await asyncio.sleep(0.2)


def load_tokenizer(spec: str):
    from transformers import AutoTokenizer

    from specd.models.resolve import resolve

    return AutoTokenizer.from_pretrained(resolve(spec))


async def serve(config, ready=None, tokenizer=None) -> None:
    from specd.serving import serve_until_signal, start_server
    from specd.telemetry import setup

    telemetry = setup("router", config.metrics_port)
    try:
        policy = PolicyFile(config.policy_file) if config.policy_file else Policy.builtin()
    except PolicyError as exc:
        raise SystemExit(f"specd router: {exc}") from None
    replicas = ReplicaSet(config.verifier or [], config.tls_ca)
    await replicas.start()
    discovery = None
    if config.verifier_dns:
        from router.discovery import DnsDiscovery

        discovery = DnsDiscovery(
            replicas, config.verifier_dns, config.verifier or [], config.dns_refresh_s
        )
        discovery.start()
    servicer = GenerationServicer(
        tokenizer or load_tokenizer(config.tokenizer),
        replicas,
        policy,
        config.default_max_new_tokens,
        config.max_new_tokens_cap,
        telemetry,
    )
    interceptors = []
    if config.auth_token_file:
        from router.auth import BearerTokenInterceptor, read_token

        interceptors.append(BearerTokenInterceptor(read_token(config.auth_token_file)))
    server, port, health = await start_server(
        config.host,
        config.port,
        lambda s: router_pb2_grpc.add_GenerationServicer_to_server(servicer, s),
        [GENERATION],
        interceptors=interceptors,
        tls_cert=config.tls_cert,
        tls_key=config.tls_key,
    )
    readiness = asyncio.get_running_loop().create_task(_track_readiness(health, replicas))
    log.info("router serving on %s:%d -> %s", config.host, port, config.verifier)
    if ready is not None:
        ready(port)
    try:  # once draining, health stays NOT_SERVING whatever the replicas say
        await serve_until_signal(server, health, config.drain_seconds)
    finally:
        readiness.cancel()
        if discovery is not None:
            await discovery.stop()
        await replicas.close()
