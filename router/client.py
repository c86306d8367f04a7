"""Python client for the public `Generation` service."""

from __future__ import annotations

from collections.abc import Iterator

from protos.specd.v1 import common_pb2, router_pb2, router_pb2_grpc
from specd.channels import open_channel
from specd.constraint import named
from specd.wire import constraint_to_proto

MODES = {
    "auto": router_pb2.SPECULATION_AUTO,
    "on": router_pb2.SPECULATION_ON,
    "off": router_pb2.SPECULATION_OFF,
}


def build_request(
    prompt: str | None = None,
    *,
    messages: list[dict] | None = None,
    token_ids: list[int] | None = None,
    max_new_tokens: int = 0,
    temperature: float = 0.0,
    top_p: float = 0.0,
    top_k: int = 0,
    seed: int | None = None,
    stop: list[str] | None = None,
    route: str = "",
    speculation: str = "auto",
    ignore_eos: bool = False,
    json_schema: dict | str | None = None,
    json_object: bool = False,
    regex: str | None = None,
    grammar: str | None = None,
    after_thinking: str = "",
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    stop_token_ids: list[int] | None = None,
    min_tokens: int = 0,
    include_stop_str_in_output: bool = False,
) -> router_pb2.GenerateRequest:
    req = router_pb2.GenerateRequest(
        max_new_tokens=max_new_tokens,
        stop=stop or [],
        route=route,
        speculation=MODES[speculation],
        ignore_eos=ignore_eos,
        params=common_pb2.SamplingParams(
            temperature=temperature, top_p=top_p, top_k=top_k, min_tokens=min_tokens
        ),
        stop_token_ids=stop_token_ids or [],
        include_stop_str_in_output=include_stop_str_in_output,
    )
    if seed is not None:
        req.params.seed = seed
    if logprobs is not None:
        req.params.logprobs = logprobs
    if prompt_logprobs is not None:
        req.params.prompt_logprobs = prompt_logprobs
    constraint = named(json_schema, json_object, regex, grammar)
    if constraint is not None:
        req.constraint.CopyFrom(constraint_to_proto(constraint))
        req.constraint.after_thinking = after_thinking
    if prompt is not None:
        req.prompt = prompt
    elif messages is not None:
        req.messages.messages.extend(router_pb2.ChatMessage(**m) for m in messages)
    elif token_ids is not None:
        req.token_ids.ids.extend(token_ids)
    return req


class SpecdClient:
    def __init__(self, address: str = "127.0.0.1:50051", tls_ca: str = ""):
        self.channel = open_channel(address, tls_ca)
        self.stub = router_pb2_grpc.GenerationStub(self.channel)

    def generate(
        self, prompt: str | None = None, *, timeout: float | None = None, metadata=None, **kwargs
    ) -> router_pb2.GenerateResponse:
        return self.stub.Generate(
            build_request(prompt, **kwargs), timeout=timeout, metadata=metadata
        )

    def stream(
        self, prompt: str | None = None, *, timeout: float | None = None, metadata=None, **kwargs
    ) -> Iterator[router_pb2.GenerateStreamResponse]:
        return self.stub.GenerateStream(
            build_request(prompt, **kwargs), timeout=timeout, metadata=metadata
        )

    def close(self) -> None:
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
