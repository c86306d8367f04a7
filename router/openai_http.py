"""The OpenAI-compatible HTTP door (`--http-port`): aiohttp on the router's event loop,
beside its gRPC server, in front of the same `Router`.

    GET  /v1/models            the served target (the draft as metadata)
    POST /v1/completions       text in; `stream: true` answers with Server-Sent Events
    POST /v1/chat/completions  messages in, the model's chat template applied
    GET  /health               200 while some verifier replica is healthy, else 503

Per request: `x-route` and `x-speculation` headers (or `route` / `speculation` in the body),
`x-request-timeout` (seconds; past it 504). The same bearer token as the gRPC listener
guards /v1/*; the same certificate makes it HTTPS. A client that disconnects cancels its
request, which frees the verifier's KV as a gRPC cancel does.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import math
import ssl
import time
import uuid

import grpc
from aiohttp import web

from protos.specd.v1 import verifier_pb2
from router import openai_schema as schema
from router.generation import Router
from router.prepare import RequestError
from specd.serving import MAX_MESSAGE_BYTES

log = logging.getLogger(__name__)
MAX_BODY_BYTES = MAX_MESSAGE_BYTES  # as the gRPC listener's
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


def error_response(status: int, message: str, param=None, code=None, headers=None):
    body = schema.error(message, ERROR_TYPES.get(status, "server_error"), param, code)
    return web.json_response(body, status=status, headers=headers)


def request_error_response(exc: RequestError) -> web.Response:
    status = HTTP_STATUS.get(exc.code, 500)
    headers = None
    if status == 429:
        ms = exc.retry_after_ms or 1000
        headers = {"Retry-After": str(math.ceil(ms / 1000)), "retry-after-ms": str(ms)}
    return error_response(status, str(exc), code=exc.code.name.lower(), headers=headers)


class OpenAIDoor:
    def __init__(
        self,
        router: Router,
        model: str,
        aliases: tuple[str, ...] = (),
        token: str = "",
    ):
        """`model`: the id clients name (and /v1/models lists); `aliases`: other names
        accepted for it; `token`: the bearer token ("" = open)."""
        self.router = router
        self.model = model
        self.names = {model, *aliases}
        self._expected = f"Bearer {token}".encode() if token else b""
        self.created = int(time.time())
        self.draining = False  # set on SIGTERM: /health answers 503

    def app(self) -> web.Application:
        app = web.Application(
            client_max_size=MAX_BODY_BYTES, middlewares=[self._errors, self._auth]
        )
        app.add_routes(
            [
                web.get("/health", self.health),
                web.get("/v1/models", self.models),
                web.post("/v1/completions", self.completions),
                web.post("/v1/chat/completions", self.chat),
            ]
        )
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
        if not self._expected or not request.path.startswith("/v1/"):
            return await handler(request)
        given = request.headers.get("Authorization", "").encode()
        if hmac.compare_digest(given, self._expected):
            return await handler(request)
        return error_response(
            401,
            "missing or wrong bearer token (header 'Authorization: Bearer <token>')",
            code="invalid_api_key",
        )

    # -- handlers ----------------------------------------------------------------------------
    async def health(self, request):
        if self.draining or not self.router.replicas.any_healthy():
            return web.Response(status=503, text="draining" if self.draining else "no replica")
        return web.Response(text="ok")

    async def models(self, request):
        card = {"id": self.model, "object": "model", "created": self.created, "owned_by": "specd"}
        replica = next((r for r in self.router.replicas.replicas.values() if r.healthy), None)
        if replica is not None:
            with contextlib.suppress(grpc.aio.AioRpcError):  # the bare card beats a 500
                info = await replica.stub.Info(verifier_pb2.InfoRequest(), timeout=2.0)
                card.update(
                    root=info.model,
                    max_model_len=info.max_context,
                    draft={
                        "id": info.drafter or None,
                        "available": bool(replica.report and replica.report.drafter_available),
                        "max_draft_tokens": info.max_draft_tokens,
                    },
                )
        return web.json_response({"object": "list", "data": [card]})

    async def completions(self, request):
        return await self._serve(request, schema.CompletionBody, "text_completion", "cmpl")

    async def chat(self, request):
        return await self._serve(request, schema.ChatBody, "chat.completion", "chatcmpl")

    async def _serve(self, request: web.Request, kind, obj: str, prefix: str):
        try:
            body = schema.parse(await request.read(), kind)
            if body.model not in self.names:
                return error_response(
                    404,
                    f"the model {body.model!r} does not exist; this server serves {self.model!r}",
                    "model",
                    "model_not_found",
                )
            headers = {k.lower(): v for k, v in request.headers.items()}
            grpc_request = schema.to_request(body, headers.get("x-speculation", ""))
            prep = self.router.prepare(grpc_request, headers, _timeout(headers))
        except schema.BodyError as exc:
            return error_response(400, str(exc), exc.param)
        except RequestError as exc:
            return request_error_response(exc)
        answer = Answer(obj, f"{prefix}-{uuid.uuid4().hex}", self.model, body, prep.prompt_ids)
        if not body.stream:
            try:
                return web.json_response(answer.whole(await self.router.generate(prep)))
            except RequestError as exc:
                return request_error_response(exc)
        return await self._stream(request, prep, answer)

    async def _stream(self, request, prep, answer: Answer):
        messages = self.router.stream(prep)
        async with contextlib.aclosing(messages):  # a disconnect closes it: KV freed
            try:
                first = await anext(messages)  # errors before the first token keep their code
            except RequestError as exc:
                return request_error_response(exc)
            response = web.StreamResponse(headers=SSE_HEADERS)
            await response.prepare(request)
            try:
                for chunk in answer.chunks(first, opening=True):
                    await _send(response, chunk)
                async for msg in messages:
                    for chunk in answer.chunks(msg):
                        await _send(response, chunk)
            except RequestError as exc:  # mid-stream: the status is sent, so an error event
                status = HTTP_STATUS.get(exc.code, 500)
                kind = ERROR_TYPES.get(status, "server_error")
                await _send(response, schema.error(str(exc), kind, code=exc.code.name.lower()))
            except ConnectionError:  # the client left: closing `messages` frees the request
                return response
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response


class Answer:
    """One request's response objects, whole or as stream chunks."""

    def __init__(self, obj: str, rid: str, model: str, body, prompt_ids: list[int]):
        self.chat = obj == "chat.completion"
        self.obj = obj
        self.head = {"id": rid, "object": obj, "created": int(time.time()), "model": model}
        self.body = body
        self.prompt_ids = prompt_ids
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def _choice(self, text: str, ids, finish: str | None, delta: dict | None = None) -> dict:
        choice = {"index": 0}
        if not self.chat:
            choice["text"] = text
        elif delta is not None:
            choice["delta"] = delta
        else:
            choice["message"] = {"role": "assistant", "content": text}
        choice["logprobs"] = None
        choice["finish_reason"] = finish
        if self.body.return_token_ids:
            choice["token_ids"] = list(ids)
        return choice

    def whole(self, resp) -> dict:
        out = {
            **self.head,
            "choices": [self._choice(resp.text, resp.token_ids, resp.finish_reason)],
            "usage": schema.usage(resp.usage),
            **schema.extension(resp),
        }
        if self.body.return_token_ids:
            out["prompt_token_ids"] = self.prompt_ids
        return out

    def chunks(self, msg, opening: bool = False) -> list[dict]:
        head = {**self.head, "object": f"{self.obj}.chunk" if self.chat else self.obj}
        usage = {"usage": None} if self.include_usage else {}
        out = []
        if opening and self.chat:
            delta = {"role": "assistant", "content": ""}
            out.append({**head, "choices": [self._choice("", [], None, delta)], **usage})
        finish = msg.finish_reason or None
        if msg.text or msg.token_ids or finish:
            delta = {"content": msg.text} if msg.text or not finish else {}
            chunk = {**head, "choices": [self._choice(msg.text, msg.token_ids, finish, delta)]}
            out.append({**chunk, **usage, **(schema.extension(msg) if finish else {})})
        if finish and self.include_usage:
            out.append({**head, "choices": [], "usage": schema.usage(msg.usage)})
        return out


async def _send(response: web.StreamResponse, chunk: dict) -> None:
    await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")


def _timeout(headers) -> float | None:
    raw = headers.get("x-request-timeout")
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not value > 0 or math.isinf(value):
        raise schema.BodyError("x-request-timeout must be a positive number of seconds")
    return value


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
    await site.start()
    return runner, runner.addresses[0][1]
