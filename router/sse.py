"""Server-Sent Events on the HTTP door: a stream opens once its request's first message has
arrived (a refusal before it keeps its own status), then each event is one `data:` line."""

from __future__ import annotations

import json

from aiohttp import web

from router.openai_errors import request_error_response
from router.prepare import RequestError

HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


async def opened(request: web.Request, messages) -> tuple[web.StreamResponse, object]:
    """(the prepared stream response, the first message), or (the error response, None)
    where the request failed before its first token."""
    try:
        first = await anext(messages)
    except RequestError as exc:
        return request_error_response(exc), None
    response = web.StreamResponse(headers=HEADERS)
    await response.prepare(request)
    return response, first


async def send(response: web.StreamResponse, event: dict) -> None:
    """One event; named by its `type` where it has one (the Responses API's, Anthropic's)."""
    named = f"event: {event['type']}\n".encode() if "type" in event else b""
    await response.write(named + b"data: " + json.dumps(event).encode() + b"\n\n")
