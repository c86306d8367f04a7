"""What the HTTP door's tests share: the cluster's policy and token, a chat, and the raw
HTTP they send where the `openai` SDK would refuse to (also test_fuzz's and
test_structured's)."""

import contextlib
import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import openai

from router.policy import Policy
from tests.cluster import TINY_MODEL_ID

POLICY = Policy.from_dict(
    {
        "default": {"speculation": "auto", "num_draft_tokens": 3, "min_acceptance": 0.0},
        "routes": {"batch": {"speculation": "off"}},
    }
)


TOKEN = "http-s3cret"


CHAT = [{"role": "user", "content": "def add(a, b):"}]
# a tool's parameters: a city, one of two
CITY = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Paris"]}}}
CITY |= {"required": ["city"], "additionalProperties": False}


def terse_chat(client, speculation: str):
    """A greedy 12-token chat answer to "ab" under the system prompt "Be terse." (what the
    Responses and Messages doors' tests compare with)."""
    return client.chat.completions.create(
        model=TINY_MODEL_ID,
        messages=[{"role": "system", "content": "Be terse."}, {"role": "user", "content": "ab"}],
        temperature=0,
        max_tokens=12,
        extra_body={"speculation": speculation},
    )


def called(question: str, arguments: str, result: str, then: str = "") -> list[dict]:
    """A chat in which the assistant called get_weather (call id "c1") with `arguments`
    and the tool answered `result`; `then`: the user's next words, if any."""
    call = {"id": "c1", "type": "function"}
    call["function"] = {"name": "get_weather", "arguments": arguments}
    chat = [
        {"role": "user", "content": question},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": result},
    ]
    return chat + ([{"role": "user", "content": then}] if then else [])


@dataclass
class Reply:
    status_code: int
    body: bytes
    headers: dict

    def json(self):
        return json.loads(self.body)

    @property
    def text(self) -> str:
        return self.body.decode()


def http(method: str, address: str, body: bytes | None = None, headers=None) -> Reply:
    """A raw HTTP call (the SDK refuses to send some of what these tests send)."""
    req = urllib.request.Request(address, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return Reply(resp.status, resp.read(), dict(resp.headers))
    except urllib.error.HTTPError as err:
        return Reply(err.code, err.read(), dict(err.headers))


def post_json(address: str, body, headers=None) -> Reply:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return http("POST", address, raw, {"content-type": "application/json", **(headers or {})})


def url(cluster, which: int | None = None) -> str:
    if which is None:
        return cluster.http
    return f"http://127.0.0.1:{cluster.doors[which][1]}"


@contextlib.contextmanager
def side_door(cluster, tokenizer, **door_fields):
    """An `openai` client of another door over the cluster's replicas: its router holds
    `tokenizer`, the door takes `door_fields` (router.openai_http.OpenAIDoor's)."""
    from router.generation import Router
    from router.openai_http import OpenAIDoor
    from router.openai_http import start as start_http

    async def door():
        router = Router(tokenizer, cluster.router_core.replicas, POLICY)
        return await start_http(OpenAIDoor(router, TINY_MODEL_ID, **door_fields), "127.0.0.1", 0)

    runner, port = cluster.run(door())
    try:
        address = f"http://127.0.0.1:{port}/v1"
        with openai.OpenAI(base_url=address, api_key="unused", max_retries=0) as client:
            yield client
    finally:
        cluster.run(runner.cleanup())


def completion_text(client, speculation: str, **fields) -> str:
    """A greedy 24-token completion of "abcabc" under `fields`, ignoring end tokens."""
    extra = {"ignore_eos": True, "speculation": speculation, **fields.pop("extra_body", {})}
    r = client.completions.create(
        model=TINY_MODEL_ID,
        prompt="abcabc",
        temperature=0,
        max_tokens=24,
        extra_body=extra,
        **fields,
    )
    return r.choices[0].text


def completion(client, speculation: str, **extra):
    """As completion_text, the whole choice, with its token ids."""
    r = client.completions.create(
        model=TINY_MODEL_ID,
        prompt="abcabc",
        temperature=0,
        max_tokens=24,
        extra_body={"ignore_eos": True, "speculation": speculation, "return_token_ids": True}
        | extra,
    )
    return r.choices[0]


def wait_for(read, done, timeout: float = 10.0):
    """`read()` until `done` holds of it (the replicas report every 100 ms)."""
    deadline = time.monotonic() + timeout
    while True:
        value = read()
        if done(value) or time.monotonic() > deadline:
            assert done(value), value
            return value
        time.sleep(0.02)
