"""What the HTTP door's tests share: the cluster's policy and token, a chat, and the raw
HTTP they send where the `openai` SDK would refuse to (also test_fuzz's and
test_structured's)."""

import json
import urllib.error
import urllib.request
from dataclasses import dataclass

from router.policy import Policy

POLICY = Policy.from_dict(
    {
        "default": {"speculation": "auto", "num_draft_tokens": 3, "min_acceptance": 0.0},
        "routes": {"batch": {"speculation": "off"}},
    }
)


TOKEN = "http-s3cret"


CHAT = [{"role": "user", "content": "def add(a, b):"}]


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
