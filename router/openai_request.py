"""An OpenAI body as the `GenerateRequest` a gRPC client would send for it: sampling
parameters with the OpenAI API's defaults, stop strings, the constraint, and the prompt
or the chat messages (the router's chat template applies them, as for gRPC)."""

from __future__ import annotations

from protos.specd.v1 import common_pb2, router_pb2
from router.client import MODES
from router.openai_schema import Body, BodyError, ChatBody

DEFAULT_TEMPERATURE = 1.0  # the OpenAI API's default (gRPC's is 0: greedy)


def to_request(body: Body, speculation_header: str = "") -> router_pb2.GenerateRequest:
    """The gRPC request a client would send for this body."""
    mode = body.speculation or speculation_header or "auto"
    if mode not in MODES:
        raise BodyError(f"x-speculation must be auto, on or off (got {mode!r})", "speculation")
    temperature = DEFAULT_TEMPERATURE if body.temperature is None else body.temperature
    params = common_pb2.SamplingParams(
        temperature=temperature,
        top_p=body.top_p or 0.0,
        top_k=max(body.top_k or 0, 0),  # vLLM's -1 is gRPC's 0: off
        min_p=body.min_p or 0.0,
    )
    if body.seed is not None:
        params.seed = body.seed
    if body.repetition_penalty is not None:
        params.repetition_penalty = body.repetition_penalty
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    request = router_pb2.GenerateRequest(
        params=params,
        max_new_tokens=body.max_new_tokens(),
        stop=stop,
        route=body.route or "",
        speculation=MODES[mode],
        ignore_eos=body.ignore_eos,
    )
    constraint = body.constraint()
    if constraint is not None:
        request.constraint.CopyFrom(constraint)
    if isinstance(body, ChatBody):
        request.messages.messages.extend(
            router_pb2.ChatMessage(role=m.role, content=m.text()) for m in body.messages
        )
    else:
        _set_prompt(request, body.prompt)
    return request


def _set_prompt(request: router_pb2.GenerateRequest, prompt) -> None:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise BodyError("a batch of prompts is not supported; send one per request", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        request.prompt = prompt
    else:
        request.token_ids.ids.extend(prompt)
