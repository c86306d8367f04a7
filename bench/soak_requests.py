"""The soak's seeded request mix (routes, sampling, speculation modes, stop strings,
streams cancelled after the first message, deadlines too short to finish), how each is
sent, and which statuses each kind may end with."""

from __future__ import annotations

import random
from dataclasses import dataclass

import grpc

ROUTES = ["default", "code", "chat", "no-such-route"]
TEXTS = [
    "def fibonacci(n):",
    "Explain what a paged KV cache is.",
    "import numpy as np\n\nx = np.arange(10)\n",
    "Write a haiku about speculative decoding.",
    "SELECT name, count(*) FROM users GROUP BY name",
    "The quick brown fox",
]


@dataclass
class SoakRequest:
    kind: str  # plain | stream-cancel | deadline | stop
    kwargs: dict
    timeout: float | None = None


def mixed_requests(n: int, seed: int = 0, max_new_tokens: int = 32) -> list[SoakRequest]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        temperature = rng.choice([0.0, 0.0, 0.7, 1.0])
        kwargs = dict(
            route=rng.choice(ROUTES),
            speculation=rng.choice(["on", "off", "auto"]),
            max_new_tokens=rng.randint(1, max_new_tokens),
            temperature=temperature,
            top_p=rng.choice([1.0, 0.9]) if temperature else 1.0,
            top_k=rng.choice([0, 20]) if temperature else 0,
            seed=i,
        )
        if rng.random() < 0.5:
            kwargs["prompt"] = rng.choice(TEXTS)
        else:
            kwargs["messages"] = [{"role": "user", "content": rng.choice(TEXTS)}]
        kind = rng.choices(["plain", "stream-cancel", "deadline", "stop"], [7, 1, 1, 1])[0]
        timeout = 60.0
        if kind == "deadline":
            timeout = rng.uniform(0.01, 0.3)
        if kind == "stop":
            kwargs["stop"] = [rng.choice(["\n", " ", "e", "."])]
        out.append(SoakRequest(kind, kwargs, timeout))
    return out


EXPECTED = {
    "plain": {grpc.StatusCode.OK},
    "stop": {grpc.StatusCode.OK},
    "stream-cancel": {grpc.StatusCode.OK, grpc.StatusCode.CANCELLED},
    "deadline": {grpc.StatusCode.OK, grpc.StatusCode.DEADLINE_EXCEEDED},
}


def send(client, req: SoakRequest) -> tuple[grpc.StatusCode, str]:
    kwargs = dict(req.kwargs)
    prompt = kwargs.pop("prompt", None)
    try:
        if req.kind == "stream-cancel":
            stream = client.stream(prompt, timeout=req.timeout, **kwargs)
            for _ in stream:
                stream.cancel()
                break
            return grpc.StatusCode.CANCELLED, ""
        client.generate(prompt, timeout=req.timeout, **kwargs)
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
