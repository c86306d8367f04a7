"""An OpenAI body as the `GenerateRequest` a gRPC client would send for it: sampling
parameters with the door's defaults, stop strings, the constraint, and the prompt or the
chat messages (the router's chat template applies them, as for gRPC)."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, fields
from pathlib import Path

from protos.specd.v1 import common_pb2, router_pb2
from router.body import BodyError
from router.client import MODES
from router.fim import infill_prompt
from router.openai_schema import Body, ChatBody, ChatMessage
from router.sglang_fields import salt
from router.tools import ToolUse
from specd.params import DEFAULTABLE, valid_default

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingDefaults:
    """What a body's absent sampling fields mean: the OpenAI API's (temperature 1, the
    rest off: gRPC's own default temperature is 0, greedy), or where the model's
    `generation_config.json` recommends values, those (vLLM's `--generation-config auto`
    and SGLang's `--sampling-defaults model` read the same five; `do_sample` is not read,
    as neither reads it). None: off."""

    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None  # llama-server's -s: every request's that names none

    @classmethod
    def from_folder(cls, folder: Path) -> SamplingDefaults:
        path = Path(folder) / "generation_config.json"
        try:
            config = json.loads(path.read_text()) if path.is_file() else {}
        except (OSError, ValueError) as exc:
            log.warning("%s unreadable (%s): the OpenAI API's sampling defaults", path, exc)
            return cls()
        found = {}
        for name in DEFAULTABLE:  # a value a request could not send is not taken
            value = config.get(name)
            if valid_default(name, value):
                found[name] = value
            elif value is not None:
                log.warning("%s: %s = %r ignored", path, name, value)
        if found:
            log.warning(
                "sampling defaults from %s for fields a request leaves out: %s", path, found
            )
        return cls(**found)

    def fill(self, body: Body) -> dict:
        """The body's sampling fields, each absent one the default."""
        return {
            f.name: getattr(self, f.name)
            if getattr(body, f.name) is None
            else getattr(body, f.name)
            for f in fields(self)
        }


OPENAI_DEFAULTS = SamplingDefaults()


def to_request(
    body: Body,
    speculation_header: str = "",
    defaults: SamplingDefaults = OPENAI_DEFAULTS,
    tools: ToolUse | None = None,
    fim: tuple[str, str, str] | None = None,
    prompt: str | list[int] | None = None,
    after_thinking: str = "",
    context: int = 0,
) -> router_pb2.GenerateRequest:
    """The gRPC request a client would send for this body; `tools`: a chat's tool use
    (`ChatBody.tool_use`), rendered by the template and, where it forces calls, the
    constraint; `fim`: the model's fill-in-the-middle markers (`router.fim`), for a
    completion's suffix; `prompt`: which of a completion's prompts (default: its first);
    `after_thinking`: the reasoning parser after whose thinking the constraint holds;
    `context`: the model's context, what `truncate_prompt_tokens: -1` keeps (vLLM's)."""
    mode = body.speculation or speculation_header or "auto"
    if mode not in MODES:
        raise BodyError(f"x-speculation must be auto, on or off (got {mode!r})", "speculation")
    sampling = defaults.fill(body)
    top_k, top_p = max(sampling["top_k"] or 0, 0), sampling["top_p"]  # vLLM's top_k -1: off
    order = {"temperature_last": False, "infill": False}
    if body.samplers is not None:  # llama-server's sampler chain (router/llamacpp_sampling.py)
        top_p = 1.0 if top_p is None else top_p
        order = body.chain(sampling["temperature"], top_k, top_p, sampling["min_p"] or 0)
        sampling = {**sampling, **{k: order[k] for k in ("temperature", "top_p", "min_p")}}
        top_k = order["top_k"]
    params = common_pb2.SamplingParams(
        temperature=sampling["temperature"],
        top_p=sampling["top_p"] or 0.0,
        top_k=top_k,
        min_p=sampling["min_p"] or 0.0,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        min_tokens=body.min_tokens,
        temperature_last=order["temperature_last"],
        infill=order["infill"],
    )
    if sampling["seed"] is not None:
        params.seed = sampling["seed"]
    if sampling["repetition_penalty"] is not None:
        params.repetition_penalty = sampling["repetition_penalty"]
    params.logit_bias.update(body.bias())
    params.allowed_token_ids.extend(body.allowed_token_ids or [])
    if body.logprobs_asked() is not None:
        params.logprobs = body.logprobs_asked()
    if body.prompt_logprobs_asked() is not None:
        params.prompt_logprobs = body.prompt_logprobs_asked()
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    keep = context if body.truncate_prompt_tokens == -1 else body.truncate_prompt_tokens or 0
    request = router_pb2.GenerateRequest(
        params=params,
        max_new_tokens=body.max_new_tokens(),
        stop=stop,
        route=body.route or "",
        speculation=MODES[mode],
        ignore_eos=body.ignore_eos,
        stop_token_ids=body.stop_token_ids or [],
        include_stop_str_in_output=body.include_stop_str_in_output or body.no_stop_trim,
        skip_special_tokens=body.skip_special_tokens,
        truncate_prompt_tokens=keep,
        cache_salt=salt(body.extra_key, body.cache_salt) or "",
        bad_words=body.bad_words or [],
        prediction=body.prediction.text() if body.prediction is not None else "",
    )
    constraint = body.constraint(tools)
    if constraint is not None:
        request.constraint.CopyFrom(constraint)
        request.constraint.after_thinking = after_thinking
    if isinstance(body, ChatBody):
        request.messages.CopyFrom(
            chat_input(body.messages, tools.tools if tools else None, body.template_options())
        )
    else:
        _set_prompt(request, body.prompts()[0] if prompt is None else prompt, body.suffix, fim)
    return request


def chat_input(
    messages: list[ChatMessage], tools: list[dict] | None, options: dict
) -> router_pb2.ChatMessages:
    """A chat's messages and tools (OpenAI's shape) as the router's template renders them,
    with the template's `options` (ChatTemplateOptions.template_options)."""
    out = router_pb2.ChatMessages(messages=[_message(m) for m in messages], **options)
    if tools is not None:
        out.tools_json = json.dumps(tools, ensure_ascii=False)
    return out


def _message(m: ChatMessage) -> router_pb2.ChatMessage:
    calls = [
        router_pb2.ToolCall(
            id=c.id,
            name=c.function.name,
            arguments=a if isinstance(a := c.function.arguments, str) else json.dumps(a),
        )
        for c in m.tool_calls or []
    ]
    return router_pb2.ChatMessage(
        role=m.role, content=m.text(), tool_calls=calls, tool_call_id=m.tool_call_id or ""
    )


def _set_prompt(request: router_pb2.GenerateRequest, prompt, suffix, fim) -> None:
    if suffix:
        if fim is None:
            raise BodyError("suffix: this model has no fill-in-the-middle tokens", "suffix")
        if not isinstance(prompt, str):
            raise BodyError("a prompt with a suffix must be text", "prompt")
        prompt = infill_prompt(prompt, suffix, fim)
    if isinstance(prompt, str):
        request.prompt = prompt
    else:
        request.token_ids.ids.extend(prompt)


def request_timeout(headers) -> float | None:
    """The request's `x-request-timeout` header, in seconds (None: none)."""
    raw = headers.get("x-request-timeout")
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not value > 0 or math.isinf(value):
        raise BodyError("x-request-timeout must be a positive number of seconds")
    return value
