"""Anthropic's Messages API answer to one request served as a chat: the message (a `text`
block, a `tool_use` block for each tool call the text held, `stop_reason` `end_turn`,
`max_tokens`, `stop_sequence` or `tool_use`), or its stream of events (`message_start`,
each block's `content_block_start` / `_delta` / `_stop`, `message_delta` with the stop
reason and usage, `message_stop`), each a Server-Sent Event named by its `type`; errors
in Anthropic's `{"type": "error", "error": {...}}` shape."""

from __future__ import annotations

import json
import uuid

from aiohttp import web

from router.openai_answer import extension_dict
from router.openai_errors import error_type
from router.reasoning import AnswerReader
from router.tools import Call, ToolUse
from specd import context_limit

# the OpenAI shape's error types, as Anthropic names them
KINDS = {"service_unavailable_error": "overloaded_error", "server_error": "api_error"}


class AnthropicAnswer:
    """One request's message, whole or as stream events (one choice)."""

    END = b""  # the stream ends with message_stop
    n_each = 1  # one choice

    def __init__(
        self, model: str, tools: ToolUse | None, reasoning: str | None = None, prompt_tokens=0
    ):
        """`reasoning`: the router's reasoning parser, whose thinking comes as a
        `thinking` block first (router.reasoning; its `signature` empty); `prompt_tokens`:
        the prompt's length, which a stream's message_start tells."""
        self.prompt_tokens = prompt_tokens
        self.id = f"msg_{uuid.uuid4().hex}"
        self.model = model
        self.reader = AnswerReader(reasoning, tools.reader() if tools is not None else None)
        self.started = False  # the stream's message_start went out
        self.block = -1  # the stream's last block's index
        self.open: str | None = None  # the stream's open block: "thinking", "text" or None
        self.called = False  # the stream held a tool call

    def whole(self, resps: list) -> dict:
        resp = resps[0]
        thinking, content, calls = self.reader.read(resp.text, final=True)
        blocks = [_thinking(thinking)] if thinking else []
        blocks += [{"type": "text", "text": content}] if content or not calls else []
        blocks += [_tool_use(c) for c in calls]
        out = self._message(blocks, resp)
        out["usage"] = _usage(resp)
        return {**out, **extension_dict(resp)}

    def chunks(self, index: int, msg) -> list[dict]:
        events = []
        if not self.started:
            self.started = True
            start = self._message([], None)
            start["usage"] = {"input_tokens": self.prompt_tokens, "output_tokens": 0}
            events.append({"type": "message_start", "message": start})
        final = bool(msg.finish_reason)
        thinking, content, calls = self.reader.read(msg.text, final)
        if thinking:
            events += self._open("thinking", _thinking(""))
            delta = {"type": "thinking_delta", "thinking": thinking}
            events.append(self._event("content_block_delta", delta=delta))
        if content:
            events += self._open("text", {"type": "text", "text": ""})
            delta = {"type": "text_delta", "text": content}
            events.append(self._event("content_block_delta", delta=delta))
        if calls or final:
            events += self._close()
        for call in calls:
            self.block, self.called = self.block + 1, True
            block = {**_tool_use(call), "input": {}}
            events.append(self._event("content_block_start", content_block=block))
            delta = {"type": "input_json_delta", "partial_json": call.arguments}
            events.append(self._event("content_block_delta", delta=delta))
            events.append(self._event("content_block_stop"))
        if final:
            reason, stop = self._stop(msg, self.called)
            usage = _usage(msg)
            delta = {"stop_reason": reason, "stop_sequence": stop}
            events.append({"type": "message_delta", "delta": delta, "usage": usage})
            events.append({"type": "message_stop", **extension_dict(msg)})
        return events

    def closing(self) -> list[dict]:
        return []

    def failed(self, exc) -> dict:
        """An error after the stream began, as Anthropic's `error` event."""
        kind = error_type(exc)
        return error_body(str(exc), kind)

    def _open(self, kind: str, block: dict) -> list[dict]:
        """The stream's block of this kind, opened unless it is the open one."""
        if self.open == kind:
            return []
        events = self._close()
        self.block, self.open = self.block + 1, kind
        return events + [self._event("content_block_start", content_block=block)]

    def _close(self) -> list[dict]:
        if self.open is None:
            return []
        self.open = None
        return [self._event("content_block_stop")]

    def _event(self, kind: str, **fields) -> dict:
        return {"type": kind, "index": self.block, **fields}

    def _message(self, blocks: list[dict], final) -> dict:
        reason, stop = self._stop(final, any(b["type"] == "tool_use" for b in blocks))
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": blocks,
            "stop_reason": reason,
            "stop_sequence": stop,
        }

    def _stop(self, final, called: bool) -> tuple[str | None, str | None]:
        """Anthropic's stop reason and the stop sequence that ended it (None while
        running)."""
        if final is None:
            return None, None
        if final.finish_reason == "length":
            return "max_tokens", None
        if final.WhichOneof("stop_reason") == "stop_string":
            return "stop_sequence", final.stop_string
        return ("tool_use" if called else "end_turn"), None


def _thinking(text: str) -> dict:
    return {"type": "thinking", "thinking": text, "signature": ""}


def _tool_use(call: Call) -> dict:
    try:
        arguments = json.loads(call.arguments)
    except ValueError:
        arguments = {}
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": arguments}


def _usage(msg) -> dict:
    """Anthropic's usage: its input tokens are those read past the cached ones."""
    cached = msg.usage.cached_prompt_tokens
    return {
        "input_tokens": msg.usage.prompt_tokens - cached,
        "output_tokens": msg.usage.completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


def error_body(message: str, kind: str) -> dict:
    return {"type": "error", "error": {"type": KINDS.get(kind, kind), "message": message}}


def in_anthropic_shape(response: web.Response) -> web.Response:
    """An error the door answered in the OpenAI shape, in Anthropic's."""
    if response.status < 400 or not isinstance(response, web.Response) or response.body is None:
        return response
    error = json.loads(response.body)["error"]
    message = error["message"]
    if error.get("code") == context_limit.CODE:
        message = context_limit.in_anthropic_words(message) or message
    body = error_body(message, error["type"])
    headers = {
        k: v for k, v in response.headers.items() if k.lower() in ("retry-after", "retry-after-ms")
    }
    return web.json_response(body, status=response.status, headers=headers)
