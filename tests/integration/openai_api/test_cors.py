"""A page of another site calling the HTTP door, as a browser does (CORS): the preflight
it sends first, then the call, whose answer it may read only if the door says so. Any site
by default, as vLLM, SGLang and llama-server allow; `--allowed-origins` and its kin narrow
it (tiny models on loopback)."""

import json

import pytest

from router.cors import CrossOrigin, cross_origin
from router.openai_http import OpenAIDoor
from router.openai_http import start as start_http
from specd.config import ConfigError, RouterConfig
from tests.cluster import TINY_MODEL_ID
from tests.integration.openai_api.door import CHAT, TOKEN, http, post_json, url

PAGE = "https://chat.example.com"
ALLOW_ORIGIN = "Access-Control-Allow-Origin"


def preflight(address: str, origin: str, method: str = "POST", headers: str = "") -> dict:
    """The browser's question before a call from `origin`: the answer's status and
    headers."""
    asked = {"Origin": origin, "Access-Control-Request-Method": method}
    if headers:
        asked["Access-Control-Request-Headers"] = headers
    reply = http("OPTIONS", address, headers=asked)
    return {"status": reply.status_code, **reply.headers}


def test_a_page_of_any_site_may_chat_with_the_token_by_default(cluster):
    chat = f"{url(cluster, 0)}/v1/chat/completions"  # the door that wants a token
    answer = preflight(chat, PAGE, headers="authorization, content-type")
    assert answer["status"] == 200  # asked without the token, as browsers ask
    assert answer[ALLOW_ORIGIN] == PAGE and answer["Access-Control-Allow-Methods"] == "POST"
    allowed = {h.strip().lower() for h in answer["Access-Control-Allow-Headers"].split(",")}
    assert allowed == {"authorization", "content-type"}
    body = {"model": TINY_MODEL_ID, "messages": CHAT, "max_tokens": 4, "stream": True}
    called = {"Origin": PAGE, "Authorization": f"Bearer {TOKEN}"}
    reply = post_json(chat, body, called)
    assert reply.status_code == 200 and reply.headers[ALLOW_ORIGIN] == PAGE
    assert "Origin" in reply.headers["Vary"]  # a cache keeps each site's answer apart
    chunks = [line for line in reply.text.splitlines() if line.startswith("data: {")]
    assert chunks and json.loads(chunks[0][6:])["object"] == "chat.completion.chunk"
    refused = post_json(chat, body, {"Origin": PAGE})  # no token: the page reads why
    assert refused.status_code == 401 and refused.headers[ALLOW_ORIGIN] == PAGE
    assert "bearer token" in refused.json()["error"]["message"]
    # without an Origin it is no browser's call: no CORS headers
    assert ALLOW_ORIGIN not in post_json(chat, body, {"Authorization": f"Bearer {TOKEN}"}).headers


@pytest.fixture(scope="module")
def door_of(cluster):
    """Starts a door over the cluster's replicas for a CrossOrigin: its address."""
    runners = []

    def start(allowed: CrossOrigin) -> str:
        door = OpenAIDoor(cluster.router_core, TINY_MODEL_ID, cross_origin=allowed)
        runner, port = cluster.run(start_http(door, "127.0.0.1", 0))
        runners.append(runner)
        return f"http://127.0.0.1:{port}"

    yield start
    for runner in runners:
        cluster.run(runner.cleanup())


def test_only_the_sites_methods_and_headers_allowed(door_of):
    allowed = CrossOrigin((PAGE,), ("post",), ("Content-Type",), credentials=True)
    door = door_of(allowed)
    chat = door + "/v1/chat/completions"
    answer = preflight(chat, PAGE, headers="content-type")
    assert (answer["status"], answer[ALLOW_ORIGIN]) == (200, PAGE)
    assert answer["Access-Control-Allow-Credentials"] == "true"
    for path, origin, method, headers in (
        (chat, "https://elsewhere.example.com", "POST", "content-type"),  # another site
        (chat, PAGE, "DELETE", ""),  # a method not allowed
        (door + "/v1/models", PAGE, "GET", ""),  # nor one that the path serves
        (chat, PAGE, "POST", "content-type, x-custom"),  # a header not allowed
    ):
        refused = preflight(path, origin, method, headers)
        assert refused["status"] == 403 and ALLOW_ORIGIN not in refused, (path, method)
    body = {"model": TINY_MODEL_ID, "messages": CHAT, "max_tokens": 2}
    assert post_json(chat, body, {"Origin": PAGE}).headers[ALLOW_ORIGIN] == PAGE
    elsewhere = post_json(chat, body, {"Origin": "https://elsewhere.example.com"})
    assert elsewhere.status_code == 200 and ALLOW_ORIGIN not in elsewhere.headers
    # no site at all: no preflight answered, no answer marked
    closed = door_of(CrossOrigin(origins=()))
    assert preflight(closed + "/v1/chat/completions", PAGE)["status"] == 405
    assert ALLOW_ORIGIN not in http("GET", closed + "/health", headers={"Origin": PAGE}).headers


@pytest.mark.parametrize(
    "given, want",
    [
        (
            '["https://a.example", "http://b.example:8080"]',
            ("https://a.example", "http://b.example:8080"),
        ),
        ("https://a.example, http://b.example", ("https://a.example", "http://b.example")),
        ("[]", ()),
        ("", ()),
    ],
)
def test_the_lists_are_json_as_vllm_takes_them_or_comma_separated(given, want):
    assert cross_origin(RouterConfig(allowed_origins=given)).origins == want


@pytest.mark.parametrize("given", ['["https://a.example"', '{"a": 1}', '[""]', "[1]"])
def test_a_malformed_list_is_refused_naming_its_flag(given):
    from launcher.cli_parser import serve_config

    with pytest.raises(ConfigError, match="allowed_methods"):
        serve_config(["serve", "router", "--allowed-methods", given])
