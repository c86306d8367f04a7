"""Undecodable request bytes get INVALID_ARGUMENT, not UNKNOWN.

grpc's aio server decodes a request before the servicer sees it; a `DecodeError` there
escapes as UNKNOWN with a logged traceback. `strict_decoding(server)` is what the
generated `add_*Servicer_to_server` functions are given instead of the server: it rewrites
each method handler so decoding failures become a marker value, and the handler answers
the marker with INVALID_ARGUMENT and the parser's message.
"""

from __future__ import annotations

import inspect

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


def _unary_unary(inner):
    async def handle(request, context):
        if isinstance(request, _Undecodable):
            await _reject(context, request)
        return await inner(request, context)

    return handle


def _unary_stream(inner):
    async def handle(request, context):
        if isinstance(request, _Undecodable):
            await _reject(context, request)
        async for response in inner(request, context):
            yield response

    return handle


def _stream_unary(inner):
    async def handle(requests, context):
        return await inner(_checked(requests, context), context)

    return handle


def _stream_stream(inner):
    if not inspect.isasyncgenfunction(inner):  # a handler that writes with context.write
        return _stream_unary(inner)

    async def handle(requests, context):
        async for response in inner(_checked(requests, context), context):
            yield response

    return handle


_WRAPPERS = {
    "unary_unary": _unary_unary,
    "unary_stream": _unary_stream,
    "stream_unary": _stream_unary,
    "stream_stream": _stream_stream,
}


def _guard(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """The same handler, with a deserializer that hands an undecodable message on as
    _Undecodable and a behaviour that rejects it with INVALID_ARGUMENT."""
    decode = handler.request_deserializer

    def safe_decode(data: bytes):
        try:
            return decode(data)
        except DecodeError as exc:
            return _Undecodable(str(exc))

    kind = next(k for k in _WRAPPERS if getattr(handler, k) is not None)
    wrapped = _WRAPPERS[kind](getattr(handler, kind))
    return handler._replace(request_deserializer=safe_decode, **{kind: wrapped})


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
