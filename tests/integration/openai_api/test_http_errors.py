"""What the OpenAI-compatible HTTP door answers a request that is wrong or unlucky: each
HTTP code in the OpenAI shape (400, 401, 404, 413, 429, 503, 504), its KV freed when the
client leaves or the deadline passes, bad bodies, headers and methods, and a bug as a 500
(tiny models on loopback)."""

import json

import openai
import pytest

import specd
from router.openai_http import MAX_BODY_BYTES
from tests.cluster import TINY_MODEL_ID
from tests.integration.openai_api.door import CHAT, TOKEN, http, post_json, url
from tests.integration.test_services import wait_idle


# -- errors, each HTTP code --------------------------------------------------------------------
def test_400_bad_parameters(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=TINY_MODEL_ID, prompt="abc", temperature=-1)
    assert "temperature" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=TINY_MODEL_ID, prompt="abc", best_of=2)
    assert err.value.body["param"] == "best_of" and "not supported" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:  # the tiny vocabulary has no FIM tokens
        client.completions.create(model=TINY_MODEL_ID, prompt="abc", suffix="xyz")
    assert err.value.body["param"] == "suffix" and "fill-in-the-middle" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=TINY_MODEL_ID, messages=CHAT, tools=[{}])
    assert err.value.body["param"] == "tools.0.type"  # tools: test_tools.py
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=TINY_MODEL_ID, messages=[{"role": "wizard", "content": "x"}]
        )
    assert "role" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=TINY_MODEL_ID, prompt="x" * 600, max_tokens=10)
    assert err.value.status_code == 400  # over the tiny models' 512-token context


def test_401_without_the_token(cluster):
    base = f"{url(cluster, 0)}/v1"
    with openai.OpenAI(base_url=base, api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError) as err:
            bad.completions.create(model=TINY_MODEL_ID, prompt="abc", max_tokens=2)
        assert "bearer token" in err.value.message
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    with openai.OpenAI(base_url=base, api_key=TOKEN, max_retries=0) as good:
        assert good.completions.create(model=TINY_MODEL_ID, prompt="abc", max_tokens=2).choices
    for method, probe in (("GET", "/health"), ("GET", "/ping"), ("POST", "/ping")):
        assert http(method, f"{url(cluster, 0)}{probe}").status_code == 200  # need no token
    assert http("GET", f"{url(cluster, 0)}/version").json() == {"version": specd.__version__}


def test_404_unknown_model(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-4o", messages=CHAT)
    assert err.value.code == "model_not_found" and "gpt-4o" in err.value.message
    assert client.models.retrieve(TINY_MODEL_ID) == client.models.list().data[0]
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("gpt-4o")
    assert err.value.code == "model_not_found"


def test_413_body_too_large(client):
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(model=TINY_MODEL_ID, prompt="a" * (MAX_BODY_BYTES + 1))
    assert err.value.status_code == 413
    assert str(MAX_BODY_BYTES) in err.value.message


def test_429_with_retry_after_when_every_queue_is_full(cluster, client):
    saved = [v.max_queue for v in cluster.verifier_servicers]
    for v in cluster.verifier_servicers:
        v.max_queue = 0  # every replica refuses: RESOURCE_EXHAUSTED
    try:
        with pytest.raises(openai.RateLimitError) as err:
            client.completions.create(model=TINY_MODEL_ID, prompt="abc", max_tokens=2)
        for stream in (False, True):
            r = post_json(
                f"{cluster.http}/v1/completions",
                {"model": TINY_MODEL_ID, "prompt": "abc", "stream": stream},
            )
            assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
    finally:
        for v, n in zip(cluster.verifier_servicers, saved, strict=True):
            v.max_queue = n
    headers = err.value.response.headers
    assert headers["retry-after"] == "1" and headers["retry-after-ms"] == "500"


def test_503_without_a_replica(cluster):
    with openai.OpenAI(base_url=f"{url(cluster, 1)}/v1", api_key="x", max_retries=0) as c:
        with pytest.raises(openai.InternalServerError) as err:
            c.completions.create(model=TINY_MODEL_ID, prompt="abc", max_tokens=2)
    assert err.value.status_code == 503 and "no healthy verifier" in err.value.message
    assert http("GET", f"{url(cluster, 1)}/health").status_code == 503
    assert http("POST", f"{url(cluster, 1)}/ping").status_code == 503


def test_504_past_the_request_timeout_frees_kv(cluster, client, aborts):
    assert wait_idle(cluster)
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(
            model=TINY_MODEL_ID,
            prompt="abc",
            max_tokens=400,
            extra_body={"ignore_eos": True},
            extra_headers={"x-request-timeout": "0.3"},
        )
    assert err.value.status_code == 504
    assert wait_idle(cluster, timeout=2.0)
    assert len(aborts) == 1  # cut short, not run to its end


# -- disconnects and bad bodies ------------------------------------------------------------------
def test_client_disconnect_mid_stream_frees_kv(cluster, client, aborts):
    assert wait_idle(cluster)
    stream = client.chat.completions.create(
        model=TINY_MODEL_ID,
        messages=CHAT,
        max_tokens=400,
        stream=True,
        extra_body={"ignore_eos": True, "speculation": "on"},
    )
    got = 0
    for chunk in stream:
        got += bool(chunk.choices and chunk.choices[0].delta.content)
        if got >= 5:
            break
    assert any(e.kv.allocator.num_used for e in cluster.engines)
    stream.close()
    assert wait_idle(cluster), "KV blocks or drafter sessions were not released"
    assert len(aborts) == 1, "the request ran on after its client left"


def test_client_giving_up_on_a_whole_answer_frees_kv(cluster, client, aborts):
    """Nothing is written before the end of a non-streamed answer: only the connection's
    close can tell the router that its client left."""
    assert wait_idle(cluster)
    with pytest.raises(openai.APITimeoutError):
        client.completions.create(
            model=TINY_MODEL_ID,
            prompt="abc",
            max_tokens=400,
            extra_body={"ignore_eos": True},
            timeout=0.3,
        )
    assert wait_idle(cluster, timeout=2.0)
    assert len(aborts) == 1, "the request ran on after its client left"


BAD_BODIES = [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "JSON object"),
    (b'{"model": "tiny", "prompt": "x", "temperature": NaN}', "NaN"),
    (json.dumps({"model": "tiny", "prompt": "x", "temperature": "hot"}).encode(), "temperature"),
    (json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 1.5}).encode(), "max_tokens"),
    (json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 0}).encode(), "max_tokens"),
    (json.dumps({"model": "tiny", "prompt": "x", "stream": "yes"}).encode(), "stream"),
    (json.dumps({"model": "tiny", "prompt": "x", "bogus": 1}).encode(), "unknown field 'bogus'"),
    (json.dumps({"model": "tiny", "prompt": ["a"] * 65, "n": 2}).encode(), "at most 128"),
    (json.dumps({"model": "tiny", "prompt": "x", "seed": -1}).encode(), "seed"),
    (json.dumps({"model": "tiny", "prompt": "x", "speculation": "maybe"}).encode(), "speculation"),
    (json.dumps({"model": 7, "prompt": "x"}).encode(), "model"),  # absent: the served one
    (json.dumps({"model": "tiny", "prompt": [500]}).encode(), "token ids"),
    (json.dumps({"model": "tiny", "prompt": ""}).encode(), "empty"),
    (json.dumps({"model": "tiny", "prompt": "x", "top_p": 0}).encode(), "top_p"),
    (json.dumps({"model": "tiny", "prompt": "x", "top_k": -2}).encode(), "top_k"),
    # valid JSON, not text: json.dumps spells the lone surrogate as its \u escape
    (json.dumps({"model": "tiny", "prompt": "a\ud800"}).encode(), "prompt: a lone UTF-16"),
    (json.dumps({"model": "tiny", "prompt": "x", "stop": ["\udfff"]}).encode(), "stop.0: a lone"),
    (b'{"model": "tiny", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "too deeply"),
]


@pytest.mark.parametrize(("raw", "says"), BAD_BODIES)
def test_bad_bodies_get_400_with_a_clear_message(cluster, raw, says):
    r = post_json(f"{cluster.http}/v1/completions", raw)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and says in error["message"], error


def test_bad_headers_and_methods(cluster):
    body = {"model": TINY_MODEL_ID, "prompt": "abc", "max_tokens": 2}
    base = cluster.http
    r = post_json(f"{base}/v1/completions", body, {"x-speculation": "maybe"})
    assert r.status_code == 400 and "x-speculation" in r.json()["error"]["message"]
    r = post_json(f"{base}/v1/completions", body, {"x-request-timeout": "soon"})
    assert r.status_code == 400 and "x-request-timeout" in r.json()["error"]["message"]
    r = post_json(
        f"{base}/v1/chat/completions",
        {
            "model": TINY_MODEL_ID,
            "messages": [{"role": "user", "content": [{"type": "image_url"}]}],
        },
    )
    assert r.status_code == 400
    r = http("GET", f"{base}/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["message"]
    r = http("GET", f"{base}/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    # after all that, the door still answers
    assert post_json(f"{base}/v1/completions", body).status_code == 200


def test_a_bug_is_a_500_in_the_openai_shape(cluster, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(cluster.router_core, "prepare", broken)
    r = post_json(f"{cluster.http}/v1/completions", {"model": TINY_MODEL_ID, "prompt": "abc"})
    assert r.status_code == 500
    assert r.json()["error"] == {
        "message": "internal error: RuntimeError",
        "type": "server_error",
        "param": None,
        "code": None,
    }
