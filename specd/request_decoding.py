"""Undecodable request bytes get INVALID_ARGUMENT, not UNKNOWN.

grpc's aio server decodes a request before the servicer sees it; a `DecodeError` there
escapes as UNKNOWN with a logged traceback. `strict_decoding(server)` is what the
generated `add_*Servicer_to_server` functions are given instead of the server: it rewrites
each method handler so decoding failures become a marker value, and the handler answers
the marker with INVALID_ARGUMENT and the parser's message.
"""

from __future__ import annotations

import grpc
from google.protobuf.message import DecodeError


class _Undecodable:
    def __init__(self, error: str):
        self.error = error


async def _reject(context, bad: _Undecodable):
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"undecodable request: {bad.error}")


async def _checked(requests, context):
    async for request in requests:
        if isinstance(request, _Undecodable):
            await _reject(context, request)
        yield request


def _guard(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    decode = handler.request_deserializer

    def safe_decode(data: bytes):
        try:
            return decode(data)
        except DecodeError as exc:
            return _Undecodable(str(exc))

    fields = {"request_deserializer": safe_decode}
    if handler.unary_unary is not None:
        inner_uu = handler.unary_unary

        async def unary_unary(request, context):
            if isinstance(request, _Undecodable):
                await _reject(context, request)
            return await inner_uu(request, context)

        fields["unary_unary"] = unary_unary
    elif handler.unary_stream is not None:
        inner_us = handler.unary_stream

        async def unary_stream(request, context):
            if isinstance(request, _Undecodable):
                await _reject(context, request)
            async for response in inner_us(request, context):
                yield response

        fields["unary_stream"] = unary_stream
    elif handler.stream_unary is not None:
        inner_su = handler.stream_unary

        async def stream_unary(requests, context):
            return await inner_su(_checked(requests, context), context)

        fields["stream_unary"] = stream_unary
    else:
        inner_ss = handler.stream_stream

        async def stream_stream(requests, context):
            async for response in inner_ss(_checked(requests, context), context):
                yield response

        fields["stream_stream"] = stream_stream
    return handler._replace(**fields)


class strict_decoding:  # noqa: N801 - used like a function: strict_decoding(server)
    """Stands in for the server while generated code registers a servicer."""

    def __init__(self, server: grpc.aio.Server):
        self._server = server

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        guarded = {name: _guard(h) for name, h in handlers.items()}
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service, guarded),)
        )
        self._server.add_registered_method_handlers(service, guarded)

    def add_generic_rpc_handlers(self, handlers) -> None:
        """The generated code also registers the unguarded handlers generically; the
        guarded ones above take their place."""
