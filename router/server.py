"""The router process: the public `Generation` gRPC service (and, with `--http-port`, the
OpenAI-compatible HTTP API) in front of the verifier replicas. Both doors are thin: the
request path is `router.generation.Router`."""

from __future__ import annotations

import dataclasses
import logging

import anyio

from protos.specd.v1 import router_pb2, router_pb2_grpc
from router.generation import Router
from router.policy import PolicyError, routing_policy
from router.prepare import Prepared, RequestError
from router.replicas import ReplicaSet
from router.tokenizer import ChatTokenizer
from specd.params import sampling_overrides
from specd.wire import ERROR_CODE_KEY

log = logging.getLogger(__name__)


class GenerationServicer(router_pb2_grpc.GenerationServicer):
    """gRPC in, gRPC out: metadata and deadline become the `Prepared` request's, a
    `RequestError` becomes the call's status."""

    def __init__(self, router: Router):
        self.router = router

    async def Generate(self, request, context):
        try:
            return await self.router.generate(self._prepare(request, context))
        except RequestError as exc:
            await _abort(context, exc)

    async def GenerateStream(self, request, context):
        try:
            async for msg in self.router.stream(self._prepare(request, context)):
                yield msg
        except RequestError as exc:
            await _abort(context, exc)

    def _prepare(self, request, context) -> Prepared:
        metadata = {k: v for k, v in context.invocation_metadata() or () if isinstance(v, str)}
        return self.router.prepare(request, metadata, context.time_remaining())


async def _abort(context, exc: RequestError):
    trailing = []
    if exc.retry_after_ms:
        trailing.append(("retry-after-ms", str(exc.retry_after_ms)))
    if exc.error_code:
        trailing.append((ERROR_CODE_KEY, exc.error_code))
    if trailing:
        context.set_trailing_metadata(tuple(trailing))
    await context.abort(exc.code, str(exc))


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
        await anyio.sleep(0.2)


def load_tokenizer(spec: str):
    """The model's tokenizer and chat template without torch in this process
    (router/tokenizer.py); a folder without a `tokenizer.json` (a slow, sentencepiece-only
    tokenizer) goes through transformers, which loads torch where it is installed."""
    from specd.models.resolve import resolve

    folder = resolve(spec)
    if (folder / "tokenizer.json").is_file():
        return ChatTokenizer(folder)
    log.warning("%s has no tokenizer.json: tokenizing with transformers (loads torch)", folder)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


async def serve(config, ready=None, tokenizer=None) -> None:
    """Serve until SIGINT/SIGTERM. The replica watchers, DNS discovery and readiness
    tracking run in one task group that ends with the server."""
    from specd.serving import serve_until_signal
    from specd.telemetry import setup

    # metrics on with a metrics port or an HTTP door (which serves them at /metrics)
    telemetry = setup("router", config.metrics_port, metrics=bool(config.http_port) or None)
    try:
        policy = routing_policy(config.policy_file, config.policy)
    except PolicyError as exc:
        raise SystemExit(f"specd router: {exc}") from None
    tokenizer = tokenizer or load_tokenizer(config.tokenizer)  # a bad name: one clear error
    if config.chat_template:  # in place of the model's (transformers' tokenizers alike)
        from specd.chat_template import read_chat_template

        tokenizer.chat_template = read_chat_template(config.chat_template)
    replicas = ReplicaSet(config.verifier or [], config.tls_ca, config.prefix_affinity)
    async with anyio.create_task_group() as background:
        await background.start(replicas.run)
        if config.verifier_dns:
            from router.discovery import DnsDiscovery

            static = config.verifier or []
            discovery = DnsDiscovery(replicas, config.verifier_dns, static, config.dns_refresh_s)
            background.start_soon(discovery.run)
        router = Router(
            tokenizer,
            replicas,
            policy,
            config.default_max_new_tokens,
            config.max_new_tokens_cap,
            telemetry,
            served_model_name(config),
        )
        server, port, health, also_stop = await _start_servers(config, router, telemetry.registry)
        background.start_soon(_track_readiness, health, replicas)
        log.info("router serving on %s:%d -> %s", config.host, port, config.verifier)
        if ready is not None:
            ready(port)
        # once draining, health stays NOT_SERVING whatever the replicas say
        await serve_until_signal(server, health, config.drain_seconds, also_stop=also_stop)
        background.cancel_scope.cancel()


def served_model_name(config) -> str:
    """The model's name to clients and on the metrics: --served-model-name, or the
    tokenizer's catalog name or path."""
    from specd.models.catalog import ALIASES

    return (config.served_model_name or [ALIASES.get(config.tokenizer, config.tokenizer)])[0]


async def _start_servers(config, router: Router, registry=None):
    """The gRPC listener (bearer token and TLS as configured) and, with http_port, the
    OpenAI-compatible door (and the metrics in `registry`). -> server, port, health, the
    door's drain (or none)."""
    from specd.serving import start_server

    servicer = GenerationServicer(router)
    interceptors, token = [], ""
    if config.auth_token_file:
        from router.auth import BearerTokenInterceptor, read_token

        token = read_token(config.auth_token_file)
        interceptors.append(BearerTokenInterceptor(token))
    server, port, health = await start_server(
        config.host,
        config.port,
        lambda s: router_pb2_grpc.add_GenerationServicer_to_server(servicer, s),
        [GENERATION],
        interceptors=interceptors,
        tls_cert=config.tls_cert,
        tls_key=config.tls_key,
    )
    try:
        also_stop = [await _start_http(config, router, token, registry)] if config.http_port else []
    except BaseException:  # the HTTP port taken: the gRPC listener goes too
        await server.stop(0)
        raise
    return server, port, health, also_stop


async def _start_http(config, router: Router, token: str, registry):
    """The OpenAI-compatible door on config.http_port, with the router's metrics
    (`registry`) at /metrics; returns its drain."""
    from router.cors import cross_origin
    from router.openai_http import OpenAIDoor, start
    from router.openai_request import OPENAI_DEFAULTS, SamplingDefaults
    from specd.models.resolve import resolve

    model = served_model_name(config)
    sampling = OPENAI_DEFAULTS
    if config.sampling_defaults == "model":
        sampling = SamplingDefaults.from_folder(resolve(config.tokenizer))
    overrides = sampling_overrides(config.override_generation_config)
    if overrides:
        sampling = dataclasses.replace(sampling, **overrides)
        log.info("sampling defaults overridden for fields a request leaves out: %s", overrides)
    if config.default_seed >= 0:
        sampling = dataclasses.replace(sampling, seed=config.default_seed)
    door = OpenAIDoor(
        router,
        model,
        (config.tokenizer,),
        token,
        registry,
        sampling,
        config.tool_call_parser,
        config.reasoning_parser,
        config.structured_outputs_in_reasoning,
        overrides,
        cross_origin(config),
        tuple(config.served_model_name[1:]),
        config.slots,
    )
    cert, key = config.http_tls_cert or config.tls_cert, config.http_tls_key or config.tls_key
    runner, port = await start(door, config.host, config.http_port, cert, key, config.drain_seconds)
    log.info(
        "router serving the OpenAI API on http%s://%s:%d/v1 as model %r (tool calls read: "
        "%s; thinking read: %s)",
        "s" if cert else "",
        config.host,
        port,
        model,
        door.call_format or "none, tool_choice auto refused",
        door.reasoning or "no, it stays in the text",
    )

    async def drain() -> None:
        door.draining = True
        await runner.cleanup()

    return drain
