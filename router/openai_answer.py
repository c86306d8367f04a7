"""The OpenAI API's response objects for one request: the whole completion, or its
Server-Sent Event chunks (usage, and specd's speculation account beside the standard
fields)."""

from __future__ import annotations

import time

from google.protobuf.json_format import MessageToDict

from protos.specd.v1 import common_pb2


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
            "usage": usage_dict(resp.usage),
            **extension_dict(resp),
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
            out.append({**chunk, **usage, **(extension_dict(msg) if finish else {})})
        if finish and self.include_usage:
            out.append({**head, "choices": [], "usage": usage_dict(msg.usage)})
        return out


def usage_dict(u: common_pb2.Usage) -> dict:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    }


def extension_dict(msg) -> dict:
    """specd's fields beside the standard ones: the speculation account and the route."""
    spec = MessageToDict(
        msg.speculation,
        preserving_proto_field_name=True,
        always_print_fields_with_no_presence=True,
    )
    out = {"speculation": spec, "route": msg.route}
    if msg.warnings:
        out["warnings"] = list(msg.warnings)
    return out
