"""The OpenAI-compatible HTTP door (`--http-port`): aiohttp on the router's event loop,
beside its gRPC server, in front of the same `Router`.

    GET  /v1/models            the served target (the draft as metadata); /v1/models/{id}
    POST /v1/completions       text in; `stream: true` answers with Server-Sent Events
    POST /v1/chat/completions  messages in, the model's chat template applied; tools
    POST /v1/responses         OpenAI's Responses API, served as the chat it is
    POST /v1/messages          Anthropic's Messages API, the same way (and count_tokens)
    GET  /health               200 while some verifier replica is healthy, else 503
    GET, POST /ping            the same (vLLM's, for SageMaker); GET /version: specd's
    POST /invocations          vLLM's for SageMaker: a chat or a completion, by its body
    POST /tokenize, /detokenize; GET /tokenizer_info  vLLM's (router/tokenize_http.py)
    POST /completion, /infill; GET /props  llama-server's own (router/llamacpp_http.py)
    POST /generate; GET /model_info   SGLang's own (router/sglang_http.py)

Per request: `x-route` and `x-speculation` headers (or `route` / `speculation` in the body),
`x-request-timeout` (seconds; past it 504). The same bearer token as the gRPC listener
guards /v1/*; the same certificate makes it HTTPS. A client that disconnects cancels its
request, which frees the verifier's KV as a gRPC cancel does.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging
import ssl
import time
import uuid
from collections.abc import AsyncIterator

import grpc
from aiohttp import web

import specd
from protos.specd.v1 import router_pb2, verifier_pb2
from router import openai_schema as schema
from router import sse
from router.anthropic_answer import AnthropicAnswer, in_anthropic_shape
from router.anthropic_schema import CountTokensBody, MessagesBody
from router.body import BodyError, has_field, parse
from router.cache_http import PATHS as CACHE_PATHS
from router.cache_http import CacheRoutes
from router.cors import ANY_ORIGIN, CrossOrigin, allow_cross_origin, is_preflight
from router.fim import markers_of
from router.generation import Router, side_by_side
from router.llamacpp_http import PATHS as LLAMACPP_PATHS
from router.llamacpp_http import LlamaCppRoutes
from router.load_http import LoadRoutes
from router.openai_answer import Answer
from router.openai_errors import error_response, request_error_response
from router.openai_request import (
    OPENAI_DEFAULTS,
    SamplingDefaults,
    chat_input,
    request_timeout,
    to_request,
)
from router.prepare import Prepared, RequestError
from router.reasoning import check_parser
from router.responses_answer import ResponsesAnswer
from router.responses_schema import ResponsesBody
from router.sglang_http import PATHS as SGLANG_PATHS
from router.sglang_http import SglangRoutes
from router.slots_http import SlotsRoutes
from router.tokenize_http import GUARDED_PATHS as TOKENIZER_PATHS
from router.tokenize_http import TokenizerRoutes
from router.tools import call_format
from specd.channels import MAX_MESSAGE_BYTES
from specd.serving import ListenError

log = logging.getLogger(__name__)
MAX_BODY_BYTES = MAX_MESSAGE_BYTES  # as the gRPC listener's
MESSAGES = "/v1/messages"  # Anthropic's Messages API: its errors in Anthropic's shape
# the token guards these beside /v1/: the other servers' own endpoints (vLLM's for
# SageMaker too), the prefix caches' and the tokenizer's settings
NATIVE_PATHS = frozenset(
    LLAMACPP_PATHS + SGLANG_PATHS + CACHE_PATHS + TOKENIZER_PATHS + ("/invocations",)
)


class OpenAIDoor:
    def __init__(
        self,
        router: Router,
        model: str,
        aliases: tuple[str, ...] = (),
        token: str = "",
        registry=None,
        sampling: SamplingDefaults = OPENAI_DEFAULTS,
        tool_call_parser: str = "auto",
        reasoning_parser: str = "",
        structured_outputs_in_reasoning: bool = False,
        overrides: dict | None = None,
        cross_origin: CrossOrigin = ANY_ORIGIN,
        also_served: tuple[str, ...] = (),
        slots: bool = True,
    ):
        """`model`: the id clients name (and /v1/models lists); `aliases`: other names
        accepted for it; `token`: the bearer token ("" = open); `registry`: the router's
        Prometheus metrics, served at /metrics (as vLLM serves its own on its API port);
        `sampling`: what a body's absent sampling fields mean; `tool_call_parser`: the
        format of the model's tool calls (`router.tools.call_format`); `reasoning_parser`:
        how its thinking is read apart (`router.reasoning`; "" = it is not), and a chat's
        constraint held after it unless `structured_outputs_in_reasoning`; `overrides`: the
        server's own sampling defaults (in `sampling` already), which llama-server's
        endpoints take over its defaults too; `cross_origin`: which other sites' pages
        may call it (router/cors.py); `also_served`: more names for the model, listed
        and answered beside `model` (vLLM's --served-model-name after the first); `slots`:
        llama-server's /slots served (router/slots_http.py)."""
        self.router = router
        self.registry = registry
        self.sampling = sampling
        self.overrides = overrides or {}
        self.cross_origin = cross_origin
        self.model = model
        self.listed = (model, *(n for n in also_served if n != model))  # /v1/models' ids
        self.names = {*self.listed, *aliases}
        self._expected = f"Bearer {token}".encode() if token else b""
        self.created = int(time.time())
        self.draining = False  # set on SIGTERM: /health answers 503
        # how the model writes a tool call
        template = getattr(router.tokenizer, "chat_template", None)
        self.call_format = call_format(tool_call_parser, template)
        self.reasoning = check_parser(reasoning_parser)
        self.after_thinking = "" if structured_outputs_in_reasoning else self.reasoning or ""
        self.fim = markers_of(router.tokenizer)  # for a completion's suffix
        self._context = 0  # the model's context, once a replica told it (context())
        self.llama = LlamaCppRoutes(self)  # llama-server's own endpoints
        self.sglang = SglangRoutes(self)  # SGLang's native ones
        self.slots = SlotsRoutes(self, slots)

    def app(self) -> web.Application:
        app = web.Application(
            client_max_size=MAX_BODY_BYTES, middlewares=[self._errors, self._auth]
        )
        app.add_routes(
            [
                web.get("/health", self.health),
                web.get("/ping", self.health),
                web.post("/ping", self.health),
                web.post("/invocations", self.invocations),
                web.get("/version", self.version),
                web.get("/v1/models", self.models),
                web.get("/v1/models/{model}", self.model_card),
                web.post("/v1/completions", self.completions),
                web.post("/v1/chat/completions", self.chat),
                web.post("/v1/responses", self.responses),
                *[
                    web.route(method, "/v1/responses/{rest:.*}", self.no_stored_responses)
                    for method in ("GET", "POST", "DELETE")
                ],
                web.post(MESSAGES, self.messages),
                web.post(f"{MESSAGES}/count_tokens", self.count_tokens),
            ]
        )
        if self.registry is not None:
            app.add_routes([web.get("/metrics", self.metrics)])
        app.add_routes(self.llama.routes())
        app.add_routes(self.sglang.routes())
        app.add_routes(self.slots.routes())
        app.add_routes(CacheRoutes(self.router).routes())
        app.add_routes(LoadRoutes(self.router).routes())
        app.add_routes(TokenizerRoutes(self).routes())
        allow_cross_origin(app, self.cross_origin)
        return app

    # -- middlewares -----------------------------------------------------------------------
    @web.middleware
    async def _errors(self, request, handler):
        """aiohttp's own refusals (404, 405, 413), and any bug, in the OpenAI shape."""
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            message = exc.text if exc.text and exc.text != exc.reason else exc.reason
            if exc.status == 413:
                message = f"the body is larger than {MAX_BODY_BYTES} bytes"
            return error_response(exc.status, message, headers=_allow(exc))
        except Exception as exc:  # a bug: logged, answered 500 (streams handle their own)
            log.exception("%s %s failed", request.method, request.path)
            return error_response(500, f"internal error: {type(exc).__name__}")

    @web.middleware
    async def _auth(self, request, handler):
        guarded = request.path.startswith(("/v1/", "/slots")) or request.path in NATIVE_PATHS
        if not self._expected or not guarded or is_preflight(request):
            return await handler(request)
        given = request.headers.get("Authorization", "").encode()
        if "x-api-key" in request.headers:  # Anthropic's clients send the key so
            given = f"Bearer {request.headers['x-api-key']}".encode()
        if hmac.compare_digest(given, self._expected):
            return await handler(request)
        refused = error_response(
            401,
            "missing or wrong bearer token (header 'Authorization: Bearer <token>', or "
            "'x-api-key: <token>')",
            code="invalid_api_key",
        )
        return in_anthropic_shape(refused) if request.path.startswith(MESSAGES) else refused

    # -- handlers ----------------------------------------------------------------------------
    async def health(self, request):
        if self.draining or not self.router.replicas.any_healthy():
            return web.Response(status=503, text="draining" if self.draining else "no replica")
        return web.Response(text="ok")

    async def version(self, request):
        return web.json_response({"version": specd.__version__})

    async def metrics(self, request):
        import prometheus_client

        body = prometheus_client.generate_latest(self.registry)
        return web.Response(
            body=body, headers={"Content-Type": prometheus_client.CONTENT_TYPE_LATEST}
        )

    async def replica_info(self):
        """A healthy replica and what it serves (`Info`), or None for either: an answer
        without it beats a 500."""
        replica = next((r for r in self.router.replicas.replicas.values() if r.healthy), None)
        if replica is None:
            return None, None
        try:
            return replica, await replica.stub.Info(verifier_pb2.InfoRequest(), timeout=2.0)
        except grpc.aio.AioRpcError:
            return replica, None

    async def context(self) -> int:
        """The served model's context, asked of a replica once (0 while none answers)."""
        if not self._context:
            _, info = await self.replica_info()
            self._context = info.max_context if info is not None else 0
        return self._context

    def chat_ids(self, body) -> list[int]:
        """The prompt a chat body's messages, tools and template options render to, as
        ids (checked as a request's: RequestError where the template cannot render it)."""
        tools = schema.tool_dicts(body.tools)
        messages = chat_input(body.messages, tools, body.template_options())
        request = router_pb2.GenerateRequest(messages=messages, max_new_tokens=1)
        return self.router.prepare(request, {}).prompt_ids

    def unknown(self, model: str | None):
        """The 404 for a model this door does not serve (None: it serves it)."""
        if model is None or model in self.names:
            return None
        return error_response(
            404,
            f"the model {model!r} does not exist; this server serves {self.model!r}",
            "model",
            "model_not_found",
        )

    async def models(self, request):
        """A card for each served name, as vLLM lists them."""
        card = await self._card()
        cards = [card | {"id": name} for name in self.listed]
        return web.json_response({"object": "list", "data": cards})

    async def model_card(self, request):
        """One model's card (the OpenAI SDK's `models.retrieve`), by any of its names."""
        name = request.match_info["model"]
        refused = self.unknown(name)
        if refused is not None:
            return refused
        card = await self._card()
        return web.json_response(card | {"id": name} if name in self.listed else card)

    async def _card(self) -> dict:
        card = {"id": self.model, "object": "model", "created": self.created, "owned_by": "specd"}
        replica, info = await self.replica_info()
        if info is not None:
            card.update(
                root=info.model,
                max_model_len=info.max_context,
                draft={
                    "id": info.drafter or None,
                    "available": bool(replica.report and replica.report.drafter_available),
                    "max_draft_tokens": info.max_draft_tokens,
                },
            )
        return card

    async def completions(self, request):
        return await self._serve(request, schema.CompletionBody, "text_completion", "cmpl")

    async def chat(self, request):
        return await self._serve(request, schema.ChatBody, "chat.completion", "chatcmpl")

    async def responses(self, request):
        """OpenAI's Responses API, served as the chat it is (router/responses_schema.py)."""
        return await self._serve(request, ResponsesBody, "response", "resp")

    async def invocations(self, request):
        """vLLM's door for SageMaker (beside /ping): a chat body served as a chat, a
        completion body as a completion."""
        raw = await request.read()
        if has_field(raw, "messages"):
            return await self.chat(request)
        if has_field(raw, "prompt"):
            return await self.completions(request)
        return error_response(
            400, "an invocation is a chat body (with messages) or a completion body (with prompt)"
        )

    async def no_stored_responses(self, request):
        """A stored response asked for (retrieved, deleted, cancelled, its input items)."""
        return error_response(
            404,
            "specd keeps no responses (it answers store: false): send the whole "
            "conversation as the next request's input",
            code="response_not_found",
        )

    async def messages(self, request):
        """Anthropic's Messages API, served as the chat it is (router/anthropic_schema.py)."""
        return in_anthropic_shape(await self._serve(request, MessagesBody, "message", "msg"))

    async def count_tokens(self, request):
        """Anthropic's count_tokens: the prompt a message would have, counted."""
        try:
            body = parse(await request.read(), CountTokensBody)
            if (refused := self.unknown(body.model)) is not None:
                return in_anthropic_shape(refused)
            ids = self.chat_ids(body.chat())
        except BodyError as exc:
            return in_anthropic_shape(error_response(400, str(exc), exc.param))
        except RequestError as exc:
            return in_anthropic_shape(request_error_response(exc))
        return web.json_response({"input_tokens": len(ids)})

    async def _serve(self, request: web.Request, kind, obj: str, prefix: str):
        try:
            body = parse(await request.read(), kind)
            if (refused := self.unknown(body.model)) is not None:
                return refused
            served_as_chat = isinstance(body, (ResponsesBody, MessagesBody))
            asked = body.chat_body() if served_as_chat else body
            headers = {k.lower(): v for k, v in request.headers.items()}
            chat = isinstance(asked, schema.ChatBody)
            tools = asked.tool_use(self.call_format) if chat else None
            prompts = asked.prompts() if isinstance(asked, schema.CompletionBody) else [None]
            door = dict(
                speculation_header=headers.get("x-speculation", ""),
                defaults=self.sampling,
                tools=tools,
                fim=self.fim,
                after_thinking=self.after_thinking if chat else "",  # a chat's thinking is read
                context=await self.context() if asked.truncate_prompt_tokens == -1 else 0,
            )
            timeout = request_timeout(headers)
            preps = [
                self.router.prepare(to_request(asked, prompt=p, **door), headers, timeout)
                for p in prompts
            ]
        except BodyError as exc:
            return error_response(400, str(exc), exc.param)
        except RequestError as exc:
            return request_error_response(exc)
        thinking = self.reasoning
        if isinstance(body, ResponsesBody):
            rid = f"resp_{uuid.uuid4().hex}"
            answer = ResponsesAnswer(rid, self.model, body, tools, thinking)
        elif isinstance(body, MessagesBody):
            answer = AnthropicAnswer(self.model, tools, thinking, len(preps[0].prompt_ids))
        else:
            rid = body.answer_id(prefix, headers.get("x-request-id"), uuid.uuid4().hex)
            decode = self.router.tokenizer.decode
            prompt_ids = [p.prompt_ids for p in preps]
            answer = Answer(obj, rid, self.model, body, prompt_ids, decode, tools, thinking)
        choices = [choice for prep in preps for choice in _choices(prep, answer.n_each)]
        if not body.stream:
            try:
                return web.json_response(answer.whole(await self._generate(choices)))
            except RequestError as exc:
                return request_error_response(exc)
        return await self._stream(request, choices, answer)

    async def _generate(self, choices: list[Prepared]) -> list:
        """Each choice's whole completion, generated side by side; the first that fails
        cancels the others (their KV freed) and answers for the request."""
        return await side_by_side([self.router.generate(c) for c in choices])

    async def _stream(self, request, choices: list[Prepared], answer: Answer):
        messages = _merged([self.router.stream(c) for c in choices])
        async with contextlib.aclosing(messages):  # a disconnect closes it: KV freed
            response, first = await sse.opened(request, messages)
            if first is None:
                return response
            try:
                for chunk in answer.chunks(*first):
                    await sse.send(response, chunk)
                async for index, msg in messages:
                    for chunk in answer.chunks(index, msg):
                        await sse.send(response, chunk)
                for chunk in answer.closing():
                    await sse.send(response, chunk)
            except RequestError as exc:  # mid-stream: the status is sent, so an error event
                await sse.send(response, answer.failed(exc))
            except ConnectionError:  # the client left: closing `messages` frees the request
                return response
            await response.write(answer.END)
            await response.write_eof()
            return response


def _choices(prep: Prepared, n: int) -> list[Prepared]:
    """One prepared request per choice. A seeded request's choice i samples from seed + i
    (choice 0 as the request alone would), as vLLM seeds them; unseeded ones draw apart."""
    if n == 1:
        return [prep]
    out = []
    for i in range(n):
        request = router_pb2.GenerateRequest()
        request.CopyFrom(prep.request)
        params = prep.params
        if request.params.HasField("seed"):
            request.params.seed = (request.params.seed + i) % (1 << 64)
            params = dataclasses.replace(params, seed=request.params.seed)
        out.append(dataclasses.replace(prep, request=request, params=params))
    return out


async def _merged(streams: list) -> AsyncIterator[tuple[int, object]]:
    """(choice, message) from every stream as each comes. The first error ends it; so
    does leaving early: either way every stream is closed, which cancels its call (the
    verifier frees its KV)."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as only:
            async for msg in only:
                yield 0, msg
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream) -> None:
        async with contextlib.aclosing(stream):
            try:
                async for msg in stream:
                    await queue.put((index, msg, None))
            except Exception as exc:  # handed to the reader, which raises it
                await queue.put((index, None, exc))
                return
        await queue.put((index, None, None))

    pumps = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(streams)
        while running:
            index, msg, exc = await queue.get()
            if exc is not None:
                raise exc
            if msg is None:
                running -= 1
            else:
                yield index, msg
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


def _allow(exc: web.HTTPException):
    return {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None


async def start(
    door: OpenAIDoor,
    host: str,
    port: int,
    cert: str = "",
    key: str = "",
    drain_seconds: float = 30.0,
) -> tuple[web.AppRunner, int]:
    """Serve `door` on host:port (0 = a free port) on the running loop; HTTPS with a
    certificate and key. Returns the runner (`await runner.cleanup()` stops it, giving
    requests in flight `drain_seconds`) and the bound port."""
    runner = web.AppRunner(
        door.app(), handler_cancellation=True, access_log=None, shutdown_timeout=drain_seconds
    )
    await runner.setup()
    context = None
    if cert or key:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(cert, key)
    site = web.TCPSite(runner, host, port, ssl_context=context)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise ListenError(
            f"cannot listen on {host}:{port} (HTTP): in use, or not this machine's"
        ) from exc
    return runner, runner.addresses[0][1]
