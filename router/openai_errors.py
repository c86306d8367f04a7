"""Errors in the OpenAI API's shape: a gRPC status as its HTTP code and error type, and
the `{"error": {...}}` body."""

from __future__ import annotations

import math

import grpc
from aiohttp import web

from router.prepare import RequestError

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


def error(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, param=None, code=None, headers=None):
    body = error(message, ERROR_TYPES.get(status, "server_error"), param, code)
    return web.json_response(body, status=status, headers=headers)


def request_error_response(exc: RequestError) -> web.Response:
    status = HTTP_STATUS.get(exc.code, 500)
    headers = None
    if status == 429:
        ms = exc.retry_after_ms or 1000
        headers = {"Retry-After": str(math.ceil(ms / 1000)), "retry-after-ms": str(ms)}
    return error_response(status, str(exc), code=error_code(exc), headers=headers)


def error_code(exc: RequestError) -> str:
    """The error's `code`: the OpenAI API's where a verifier named one, else the status's."""
    return exc.error_code or exc.code.name.lower()


def error_type(exc: RequestError) -> str:
    """The OpenAI API's error type for the HTTP status a request's gRPC status maps to."""
    return ERROR_TYPES.get(HTTP_STATUS.get(exc.code, 500), "server_error")


def error_event(exc: RequestError) -> dict:
    """A failure after the stream began (its HTTP status already sent): an error event."""
    return error(str(exc), error_type(exc), code=error_code(exc))
