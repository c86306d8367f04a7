"""A bearer-token check on the router's public API (`--auth-token-file`).

Health checks and reflection stay open (probes do not carry tokens); every other call needs
`authorization: Bearer <token>` metadata, or it gets UNAUTHENTICATED.
"""

from __future__ import annotations

import hmac

import grpc

OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def read_token(path: str) -> str:
    token = open(path).read().strip()
    if not token:
        raise ValueError(f"auth token file {path} is empty")
    return token


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    def _authorized(self, metadata) -> bool:
        for key, value in metadata or ():
            if key == "authorization":
                given = value.encode() if isinstance(value, str) else value
                return hmac.compare_digest(given, self._expected)
        return False

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_PREFIXES):
            return handler
        if self._authorized(details.invocation_metadata):
            return handler
        return _deny(handler)


def _deny(handler):
    message = "missing or wrong bearer token (metadata 'authorization: Bearer <token>')"

    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def streaming(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this an async generator

    if handler.request_streaming:
        raise RuntimeError("the router has no client-streaming methods")
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(
            streaming,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
    return grpc.unary_unary_rpc_method_handler(
        unary,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
