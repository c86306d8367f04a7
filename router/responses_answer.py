"""The Responses API's answer to one request served as a chat: the response object (an
assistant message item with the text, a `function_call` item for each tool call the text
held), or its stream of semantic events, each a Server-Sent Event named by its `type`
(`response.created` ... `response.output_text.delta` ... `response.completed`, or
`response.incomplete` at the token limit), numbered by `sequence_number`."""

from __future__ import annotations

import time
import uuid

from router.openai_answer import extension_dict
from router.openai_errors import error_type
from router.reasoning import AnswerReader
from router.responses_schema import ResponsesBody
from router.tools import Call, ToolUse


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesAnswer:
    """One request's response object, whole or as stream events (one choice)."""

    END = b""  # the stream ends with its last event, no `[DONE]`
    n_each = 1  # one choice

    def __init__(
        self, rid: str, model: str, body: ResponsesBody, tools: ToolUse | None, reasoning=None
    ):
        """`reasoning`: the router's reasoning parser, whose thinking comes as a
        `reasoning` item before the message (router.reasoning)."""
        self.body = body
        self.reader = AnswerReader(reasoning, tools.reader() if tools is not None else None)
        self.head = {
            "id": rid,
            "object": "response",
            "created_at": int(time.time()),
            "model": model,
        }
        self.sequence = 0
        self.output: list[dict] = []  # items so far (a stream's)
        self.message: dict | None = None  # a stream's message item while it is open
        self.thought: dict | None = None  # a stream's reasoning item while it is open
        self.started = False

    # -- the whole answer ------------------------------------------------------------------
    def whole(self, resps: list) -> dict:
        resp = resps[0]
        thinking, content, calls = self.reader.read(resp.text, final=True)
        status = "incomplete" if resp.finish_reason == "length" else "completed"
        cut = status == "incomplete" and not (content or calls)  # it ended thinking
        items = (
            [self._reasoning(thinking, "incomplete" if cut else "completed")] if thinking else []
        )
        items += [self._message(content, status)] if content or not calls else []
        items += [self._call(c) for c in calls]
        return self._response(items, resp)

    # -- a stream --------------------------------------------------------------------------
    def chunks(self, index: int, msg) -> list[dict]:
        """The events of one stream message (`index`: always 0, one choice)."""
        events = [] if self.started else self._opening()
        self.started = True
        thinking, content, calls = self.reader.read(msg.text, final=bool(msg.finish_reason))
        if thinking:
            events += self._thinking(thinking)
        if content or calls or msg.finish_reason:
            cut = msg.finish_reason == "length" and not (content or calls)
            events += self._close_thought(cut)
        if content:
            events += self._text(content)
        if calls or msg.finish_reason:
            events += self._close_message(msg.finish_reason)
        for call in calls:
            events += self._call_events(self._call(call))
        if msg.finish_reason:
            done = self._response(self.output, msg)
            kind = "response.completed" if done["status"] == "completed" else "response.incomplete"
            events.append(self._event(kind, response=done))
        return events

    def closing(self) -> list[dict]:
        return []

    def failed(self, exc) -> dict:
        """An error after the stream began, as the API's `error` event."""
        kind = error_type(exc)
        return self._event("error", code=kind, message=str(exc), param=None)

    def _opening(self) -> list[dict]:
        begun = self._response([], None)
        return [
            self._event("response.created", response=begun),
            self._event("response.in_progress", response=begun),
        ]

    def _text(self, delta: str) -> list[dict]:
        events = []
        if self.message is None:
            self.message = self._message("", "in_progress")
            events += self._item_added(self.message)
            part = {"type": "output_text", "text": "", "annotations": []}
            events.append(self._event("response.content_part.added", **self._at(), part=part))
        self.message["content"][0]["text"] += delta
        delta_event = self._event(
            "response.output_text.delta", **self._at(), delta=delta, logprobs=[]
        )
        events.append(delta_event)
        return events

    def _thinking(self, delta: str) -> list[dict]:
        events = []
        if self.thought is None:
            self.thought = self._reasoning("", "in_progress")
            events += self._item_added(self.thought)
        self.thought["content"][0]["text"] += delta
        at = {"item_id": self.thought["id"], "output_index": len(self.output) - 1}
        events.append(
            self._event("response.reasoning_text.delta", **at, content_index=0, delta=delta)
        )
        return events

    def _close_thought(self, cut: bool) -> list[dict]:
        """The reasoning item done (`cut`: the token limit ended it)."""
        thought, self.thought = self.thought, None
        if thought is None:
            return []
        thought["status"] = "incomplete" if cut else "completed"
        index = self.output.index(thought)
        at = {"item_id": thought["id"], "output_index": index, "content_index": 0}
        text = thought["content"][0]["text"]
        return [
            self._event("response.reasoning_text.done", **at, text=text),
            self._event("response.output_item.done", output_index=index, item=thought),
        ]

    def _close_message(self, finish: str) -> list[dict]:
        message, self.message = self.message, None
        if message is None:
            return []
        message["status"] = "incomplete" if finish == "length" else "completed"
        part = message["content"][0]
        at = {"item_id": message["id"], "output_index": len(self.output) - 1, "content_index": 0}
        return [
            self._event("response.output_text.done", **at, text=part["text"], logprobs=[]),
            self._event("response.content_part.done", **at, part=part),
            self._event("response.output_item.done", output_index=at["output_index"], item=message),
        ]

    def _call_events(self, item: dict) -> list[dict]:
        events = self._item_added({**item, "arguments": "", "status": "in_progress"})
        at = {"item_id": item["id"], "output_index": len(self.output) - 1}
        args = item["arguments"]
        events.append(self._event("response.function_call_arguments.delta", **at, delta=args))
        events.append(self._event("response.function_call_arguments.done", **at, arguments=args))
        self.output[-1] = item
        events.append(
            self._event("response.output_item.done", output_index=at["output_index"], item=item)
        )
        return events

    def _item_added(self, item: dict) -> list[dict]:
        self.output.append(item)
        index = len(self.output) - 1
        return [self._event("response.output_item.added", output_index=index, item=item)]

    def _at(self) -> dict:
        index = len(self.output) - 1
        return {"item_id": self.message["id"], "output_index": index, "content_index": 0}

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    # -- shapes ------------------------------------------------------------------------------
    @staticmethod
    def _reasoning(text: str, status: str) -> dict:
        return {
            "id": _item_id("rs"),
            "type": "reasoning",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": text}],
            "status": status,
        }

    @staticmethod
    def _message(text: str, status: str) -> dict:
        return {
            "id": _item_id("msg"),
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": []}],
        }

    @staticmethod
    def _call(call: Call) -> dict:
        return {
            "id": _item_id("fc"),
            "type": "function_call",
            "call_id": call.id,
            "name": call.name,
            "arguments": call.arguments,
            "status": "completed",
        }

    def _response(self, output: list[dict], final) -> dict:
        """The response object: `final` the last message (None: still in progress)."""
        body = self.body
        out = {
            **self.head,
            "status": "in_progress",
            "error": None,
            "incomplete_details": None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "max_tool_calls": body.max_tool_calls,
            "metadata": body.metadata or {},
            "output": list(output),
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "store": False,
            "temperature": body.temperature,
            "text": {"format": _text_format(body)},
            "tool_choice": _tool_choice(body),
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
            "top_p": body.top_p,
            "truncation": "disabled",
            "usage": None,
        }
        if final is None:
            return out
        incomplete = final.finish_reason == "length"
        out["status"] = "incomplete" if incomplete else "completed"
        if incomplete:
            out["incomplete_details"] = {"reason": "max_output_tokens"}
        u = final.usage
        out["usage"] = {
            "input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt_tokens + u.completion_tokens,
        }
        return {**out, **extension_dict(final)}


def _tool_choice(body: ResponsesBody):
    choice = body.tool_choice
    if choice is None:
        return "auto"
    return choice if isinstance(choice, str) else choice.model_dump()


def _text_format(body: ResponsesBody) -> dict:
    fmt = body.text.format if body.text is not None else None
    return {"type": "text"} if fmt is None else fmt.model_dump(by_alias=True, exclude_none=True)
