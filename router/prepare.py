"""A request checked and tokenized once, before any replica sees it: what every attempt
sends (`Prepared`), or a `RequestError` carrying the gRPC status it ends with (the HTTP door
maps it to an HTTP code)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import grpc

from protos.specd.v1 import common_pb2, router_pb2
from router.policy import Policy, PolicyFile
from specd import json_text
from specd.params import SamplingParams
from specd.wire import ERROR_CODE_KEY, UNTIL_CONTEXT, constraint_from_proto, params_from_proto

# the roles of the chat format every HF chat template is written for; a template that
# cannot render one of them raises, and that is refused too (see _tokenize)
ROLES = frozenset({"system", "user", "assistant", "tool"})
# OpenAI's name for the system role of its newer models, which its clients send: rendered
# as "system" by a template that does not compare a role with it (as llama.cpp does), as
# itself otherwise; a template that only says the word in its text does not name the role
DEVELOPER = "developer"
_NAMED = (f"'{DEVELOPER}'", f'"{DEVELOPER}"')


class RequestError(Exception):
    """A request that ends with a status: `retry_after_ms` is the hint a verifier sent with
    RESOURCE_EXHAUSTED (0: none)."""

    def __init__(
        self, code: grpc.StatusCode, message: str, retry_after_ms: int = 0, error_code: str = ""
    ):
        super().__init__(message)
        self.code = code
        self.retry_after_ms = retry_after_ms
        self.error_code = error_code  # the OpenAI API's code where a verifier named one

    @classmethod
    def from_rpc(cls, exc: grpc.aio.AioRpcError) -> RequestError:
        trailing = dict(exc.trailing_metadata() or ())
        hint = trailing.get("retry-after-ms", "0")
        retry = int(hint) if str(hint).isdigit() else 0
        code = str(trailing.get(ERROR_CODE_KEY, ""))
        return cls(exc.code(), exc.details() or str(exc.code()), retry, code)


@dataclass
class Prepared:
    """A validated request: what every attempt on a replica sends."""

    request: router_pb2.GenerateRequest
    params: SamplingParams  # request.params, checked
    prompt_ids: list[int]
    route: str
    warnings: list[str]
    policy: object
    max_new_tokens: int
    metadata: Mapping[str, str]  # the caller's gRPC metadata or HTTP headers (lower case)
    deadline: float | None  # time.monotonic() past which the request fails
    prediction_ids: list[int] = field(default_factory=list)  # request.prediction's tokens


class Preparer:
    """Validation and tokenization with the router's tokenizer, route policies and token
    limits."""

    def __init__(
        self, tokenizer, policy: Policy, default_max_new_tokens: int, max_new_tokens_cap: int
    ):
        self.tokenizer = tokenizer
        self.policy = policy
        self.default_max_new_tokens = default_max_new_tokens
        self.max_new_tokens_cap = max_new_tokens_cap

    def prepare(
        self,
        request: router_pb2.GenerateRequest,
        metadata: Mapping[str, str],
        timeout: float | None = None,
    ) -> Prepared:
        """Check the request and tokenize its input; raises RequestError(INVALID_ARGUMENT).
        `metadata`: lower-case keys (x-route, traceparent); `timeout`: seconds, or None."""
        which = request.WhichOneof("input")
        if which is None:
            raise _invalid("one of prompt, messages or token_ids is required")
        if request.speculation not in router_pb2.SpeculationMode.values():
            names = ", ".join(router_pb2.SpeculationMode.keys())
            raise _invalid(f"speculation must be one of {names} (got {request.speculation})")
        if request.bad_words:  # as token ids, which the verifier bans
            words = [common_pb2.TokenSequence(ids=w) for w in self._bad_words(request.bad_words)]
            del request.params.bad_words[:]
            request.params.bad_words.extend(words)
        params = params_from_proto(request.params)
        try:
            params.validate()
            constraint = constraint_from_proto(request.constraint)
            if constraint is not None:
                constraint.grammar()  # compiled (and cached) here: a bad one never travels
        except ValueError as exc:
            raise _invalid(str(exc)) from None
        max_new = request.max_new_tokens or self.default_max_new_tokens
        cap = self.max_new_tokens_cap  # 0: only the verifier's context and KV pool bound it
        if max_new == UNTIL_CONTEXT and cap:
            max_new = cap
        elif max_new < UNTIL_CONTEXT or (cap and max_new > cap):
            limit = f"in [1, {cap}]" if cap else "positive"
            raise _invalid(f"max_new_tokens must be {limit}, or -1: what the context leaves")
        if params.min_tokens > max_new > 0:
            raise _invalid(f"min_tokens ({params.min_tokens}) exceeds max_new_tokens ({max_new})")
        vocab = len(self.tokenizer)
        if any(not 0 <= t < vocab for t in request.stop_token_ids):
            raise _invalid(f"stop_token_ids must be token ids in [0, {vocab})")
        if request.truncate_prompt_tokens < 0:
            raise _invalid("truncate_prompt_tokens must be >= 0 (0: the whole prompt)")
        ids = self._tokenize(request, which)
        if request.truncate_prompt_tokens:  # the prompt's last tokens, as vLLM cuts it
            ids = ids[-request.truncate_prompt_tokens :]
        if not ids:
            raise _invalid("the prompt is empty")
        route_name = request.route or metadata.get("x-route", "") or "default"
        policy_set = self.policy.current() if isinstance(self.policy, PolicyFile) else self.policy
        route, policy, warning = policy_set.for_route(route_name)
        deadline = None if timeout is None else time.monotonic() + timeout
        warnings = [warning] if warning else []
        prediction = []  # as the output would spell it: no special tokens added
        if request.prediction:
            prediction = self.tokenizer(request.prediction, add_special_tokens=False)["input_ids"]
        return Prepared(
            request, params, ids, route, warnings, policy, max_new, metadata, deadline,
            list(prediction),
        )  # fmt: skip

    def _bad_words(self, words) -> list[list[int]]:
        """vLLM's bad_words as token ids: each word as it stands (leading spaces off), and
        after a space where that spells it with another first token and as many tokens
        (the word in the middle of a text)."""
        out = []
        for word in words:
            alone = self.tokenizer(word.lstrip(), add_special_tokens=False)["input_ids"]
            spaced = self.tokenizer(" " + word.lstrip(), add_special_tokens=False)["input_ids"]
            if not alone:
                raise _invalid(f"bad_words: {word!r} has no tokens")
            out.append(list(alone))
            if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
                out.append(list(spaced))
        return out

    def _tokenize(self, request, which: str) -> list[int]:
        if which == "token_ids":
            ids = list(request.token_ids.ids)
            vocab = len(self.tokenizer)
            if any(not 0 <= t < vocab for t in ids):
                raise _invalid(f"token ids must be in [0, {vocab})")
            return ids
        if which == "prompt":
            # the special tokens the tokenizer adds (a Llama's BOS), as vLLM's completions
            prompt = self.tokenizer(request.prompt, add_special_tokens=True)
            return list(prompt["input_ids"])
        messages = [_message(m) for m in request.messages.messages]
        if not messages:
            return []
        options = _template_options(request.messages)
        tools = _tools(request.messages.tools_json)
        template = str(self.tokenizer.chat_template or "")  # transformers may hold several
        developer = DEVELOPER if any(q in template for q in _NAMED) else "system"
        for i, m in enumerate(messages):
            if m["role"] == DEVELOPER:
                m["role"] = developer
            elif m["role"] not in ROLES:
                roles = ", ".join(sorted(ROLES | {DEVELOPER}))
                raise _invalid(f"messages[{i}].role {m['role']!r} is not one of {roles}")
        try:
            enc = self.tokenizer.apply_chat_template(messages, tokenize=True, **tools, **options)
        except Exception as exc:  # the template rejects the conversation
            raise _invalid(f"chat template failed: {exc}") from None
        return list(enc["input_ids"] if hasattr(enc, "keys") else enc)


def _message(m: router_pb2.ChatMessage) -> dict:
    """A message as chat templates read it (transformers' shape): a call's arguments an
    object where they are one, as vLLM hands them over."""
    out = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": _object_or_text(c.arguments)},
            }
            for c in m.tool_calls
        ]
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    return out


def _object_or_text(arguments: str):
    try:
        value = json_text.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


def _tools(tools_json: str) -> dict:
    """The template's `tools` keyword, if the request has tools."""
    if not tools_json:
        return {}
    try:
        tools = json_text.loads(tools_json)
    except ValueError:
        tools = None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise _invalid("messages.tools_json must be a JSON array of objects")
    return {"tools": tools}


def _template_options(chat: router_pb2.ChatMessages) -> dict:
    """apply_chat_template's keywords for the chat's options, checked."""
    add = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else None
    if add and chat.continue_final_message:
        raise _invalid("continue_final_message needs add_generation_prompt false")
    options = {
        "add_generation_prompt": not chat.continue_final_message if add is None else add,
        "continue_final_message": chat.continue_final_message,
    }
    if not chat.chat_template_kwargs_json:
        return options
    try:
        kwargs = json_text.loads(chat.chat_template_kwargs_json)
    except ValueError:
        kwargs = None
    if not isinstance(kwargs, dict):
        raise _invalid("messages.chat_template_kwargs_json must be a JSON object")
    if taken := sorted(kwargs.keys() & (options.keys() | {"messages", "tools", "tokenize"})):
        raise _invalid(f"chat_template_kwargs may not set {', '.join(taken)}")
    return {**kwargs, **options}


def _invalid(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)
