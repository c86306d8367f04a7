"""The router's OpenAI-compatible HTTP door, driven by the official `openai` SDK (and raw
HTTP where the SDK would refuse to send something), against tiny models on loopback; its
sampling fields beyond the basics are test_sampling's."""

import json

import openai
import pytest

from router.openai_http import MAX_BODY_BYTES
from tests.cluster import TINY_MODEL_ID
from tests.integration.openai_api.door import CHAT, TOKEN, http, post_json, url
from tests.integration.test_services import wait_idle


# -- answers ---------------------------------------------------------------------------------
def test_models_lists_the_target_and_its_draft(client):
    models = client.models.list().data
    assert [m.id for m in models] == [TINY_MODEL_ID]
    card = models[0].model_dump()
    assert card["owned_by"] == "specd"
    assert card["root"] == "tiny"  # the verifier's own name for its model
    assert card["max_model_len"] == 512
    assert card["draft"]["id"] == "tiny-draft"
    assert card["draft"]["available"] is True


def test_tokenize_and_detokenize_as_vllm_answers_them(cluster, client):
    """A prompt's ids and a chat's (as the chat endpoint renders it), the context they go
    to, and ids back to text; bad bodies refused naming the field."""
    said = post_json(f"{cluster.http}/tokenize", {"model": TINY_MODEL_ID, "prompt": "abc"}).json()
    assert said == {"count": 3, "max_model_len": 512, "tokens": [65, 66, 67]}
    chat = client.chat.completions.create(
        model=TINY_MODEL_ID, messages=CHAT, max_tokens=1, extra_body={"return_token_ids": True}
    )
    said = post_json(f"{cluster.http}/tokenize", {"messages": CHAT}).json()
    assert said["tokens"] == chat.model_extra["prompt_token_ids"] and said["count"] > 10
    back = post_json(f"{cluster.http}/detokenize", {"tokens": said["tokens"]}).json()
    # the template's newline is not in the character vocabulary: its unknown token, "?"
    text = "user: def add(a, b):?assistant: "
    assert back == {"prompt": text, "content": text}  # vLLM's field and llama-server's
    for path, body, code, param in [
        ("tokenize", {"prompt": "a", "messages": CHAT}, 400, None),
        ("tokenize", {}, 400, None),
        ("tokenize", {"prompt": "a", "model": "gpt-4"}, 404, "model"),
        ("detokenize", {"tokens": [96]}, 400, "tokens"),
        ("detokenize", {"tokens": [-1]}, 400, "tokens.0"),
        ("detokenize", {"tokens": "abc"}, 400, "tokens"),
    ]:
        reply = post_json(f"{cluster.http}/{path}", body)
        assert reply.status_code == code and reply.json()["error"]["param"] == param, (
            body,
            reply.text,
        )


def test_a_chat_that_names_no_limit_runs_until_the_context_is_full(client):
    """As vLLM and the OpenAI API answer it: until the model stops or its context (the
    card's max_model_len) is full; a completion that names none gets the router's default
    (256), and a chat whose prompt fills the context is refused."""
    context = client.models.list().data[0].model_dump()["max_model_len"]
    extra = {"ignore_eos": True}
    chat = client.chat.completions.create(
        model=TINY_MODEL_ID, messages=CHAT, temperature=0, extra_body=extra
    )
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage.total_tokens == context > chat.usage.prompt_tokens + 256
    completion = client.completions.create(
        model=TINY_MODEL_ID, prompt="def f(x):", temperature=0, extra_body=extra
    )
    assert completion.usage.completion_tokens == 256
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=TINY_MODEL_ID, messages=[{"role": "user", "content": "x" * context}]
        )
    assert "context" in err.value.message


@pytest.mark.parametrize("speculation", ["on", "off"])
def test_chat_equals_grpc_token_for_token(client, grpc_client, speculation):
    r = client.chat.completions.create(
        model=TINY_MODEL_ID,
        messages=CHAT,
        temperature=0,
        max_tokens=24,
        extra_body={"ignore_eos": True, "return_token_ids": True, "speculation": speculation},
    )
    g = grpc_client.generate(
        messages=CHAT, max_new_tokens=24, ignore_eos=True, speculation=speculation
    )
    choice = r.choices[0]
    assert choice.model_extra["token_ids"] == list(g.token_ids)
    assert choice.message.content == g.text and choice.message.role == "assistant"
    assert choice.finish_reason == "length" == g.finish_reason
    assert r.usage.prompt_tokens == g.usage.prompt_tokens
    assert r.usage.completion_tokens == 24
    assert r.usage.total_tokens == r.usage.prompt_tokens + 24
    assert r.object == "chat.completion" and r.model == TINY_MODEL_ID and r.id
    spec = r.model_extra["speculation"]
    assert spec["enabled"] is (speculation == "on")
    assert spec["reason"] == g.speculation.reason
    assert r.model_extra["route"] == "default"


def test_completion_equals_grpc_stream_and_not(client, grpc_client):
    prompt = "abcabcabc"
    g = grpc_client.generate(prompt, max_new_tokens=30, ignore_eos=True, speculation="on")
    whole = client.completions.create(
        model=TINY_MODEL_ID,
        prompt=prompt,
        temperature=0,
        max_tokens=30,
        extra_body={"ignore_eos": True, "speculation": "on", "return_token_ids": True},
    )
    assert whole.choices[0].text == g.text
    assert whole.choices[0].model_extra["token_ids"] == list(g.token_ids)
    assert whole.object == "text_completion"
    chunks = list(
        client.completions.create(
            model=TINY_MODEL_ID,
            prompt=prompt,
            temperature=0,
            max_tokens=30,
            stream=True,
            extra_body={"ignore_eos": True, "speculation": "on", "return_token_ids": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == g.text
    assert [t for c in chunks for t in c.choices[0].model_extra["token_ids"]] == list(g.token_ids)
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert chunks[-1].model_extra["speculation"]["drafted"] > 0


def test_a_batch_of_prompts_answers_each_as_vllm(client):
    """`prompt` as a list: each prompt's `n` choices in order, each as the prompt alone
    answers it; usage counts each prompt once; `echo` and token ids per prompt; streamed
    alike."""
    prompts = ["def f(x):", "abc"]
    ask = dict(model=TINY_MODEL_ID, temperature=0, max_tokens=6, echo=True)
    extra = {"return_token_ids": True, "ignore_eos": True}
    alone = [client.completions.create(**ask, prompt=p, extra_body=extra) for p in prompts]
    batch = client.completions.create(**ask, prompt=prompts, n=2, extra_body=extra)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    for i, choice in enumerate(batch.choices):
        one = alone[i // 2].choices[0]
        assert (
            choice.text == one.text
            and choice.model_extra["token_ids"] == one.model_extra["token_ids"]
        )
        assert (
            choice.model_extra["prompt_token_ids"] == alone[i // 2].model_extra["prompt_token_ids"]
        )
    ids = client.completions.create(**ask, prompt=[[65, 66, 67], [68, 69]])
    assert ids.choices[0].text.startswith("abc") and ids.choices[1].text.startswith("de")
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == 4 * 6
    texts = ["", "", "", ""]
    for chunk in client.completions.create(
        **ask, prompt=prompts, n=2, stream=True, extra_body=extra
    ):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in batch.choices]


def test_prompt_as_token_ids(client, grpc_client):
    ids = [10, 11, 12, 13]
    r = client.completions.create(model=TINY_MODEL_ID, prompt=ids, temperature=0, max_tokens=8)
    g = grpc_client.generate(token_ids=ids, max_new_tokens=8)
    assert r.choices[0].text == g.text


def test_chat_stream_shape_and_usage(client, grpc_client):
    stream = client.chat.completions.create(
        model=TINY_MODEL_ID,
        messages=CHAT,
        temperature=0,
        max_tokens=20,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "speculation": "on"},
    )
    chunks = list(stream)
    # speculation pinned: under auto each request's decision follows the cost model of the
    # moment (the two got "on" and "off:cost" in a clean-clone run)
    g = grpc_client.generate(messages=CHAT, max_new_tokens=20, ignore_eos=True, speculation="on")
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    *body, usage_chunk = chunks
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 20
    assert all(c.usage is None for c in body)
    assert "".join(c.choices[0].delta.content or "" for c in body) == g.text
    assert body[-1].choices[0].finish_reason == "length"
    assert body[-1].model_extra["speculation"]["reason"] == g.speculation.reason


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(client, grpc_client):
    """vLLM's `continuous_usage_stats`: with include_usage, each chunk carries the prompt's
    tokens and the choice's tokens so far, the role chunk none yet; the usage chunk still
    ends the stream. Without include_usage it adds nothing."""
    ask = dict(model=TINY_MODEL_ID, messages=CHAT, temperature=0, max_tokens=20, stream=True)
    ask["extra_body"] = {"ignore_eos": True, "speculation": "on"}
    both = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(client.chat.completions.create(**ask, stream_options=both))
    g = grpc_client.generate(messages=CHAT, max_new_tokens=20, ignore_eos=True, speculation="on")
    *body, usage_chunk = chunks
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 20
    prompt = g.usage.prompt_tokens
    assert all(c.usage.prompt_tokens == prompt for c in chunks)
    so_far = [c.usage.completion_tokens for c in body]
    assert so_far[0] == 0 and so_far[-1] == 20 and so_far == sorted(so_far)
    assert len(set(so_far)) == len(body)  # each chunk after the role's brought tokens
    assert all(c.usage.total_tokens == prompt + c.usage.completion_tokens for c in chunks)
    alone = {"continuous_usage_stats": True}
    assert all(c.usage is None for c in client.chat.completions.create(**ask, stream_options=alone))


def test_stream_without_usage_has_no_usage_chunk(client):
    chunks = list(
        client.chat.completions.create(
            model=TINY_MODEL_ID, messages=CHAT, max_tokens=5, temperature=0, stream=True
        )
    )
    assert chunks[-1].choices[0].finish_reason is not None
    assert all(c.usage is None for c in chunks)


def test_stop_strings_cut_as_grpc_does(client, grpc_client):
    g = grpc_client.generate("abcabcabc", max_new_tokens=40, ignore_eos=True)
    stop = g.text[5:7]  # a string the greedy answer is known to contain
    cut = grpc_client.generate("abcabcabc", max_new_tokens=40, ignore_eos=True, stop=[stop])
    for stream in (False, True):
        r = client.completions.create(
            model=TINY_MODEL_ID,
            prompt="abcabcabc",
            temperature=0,
            max_tokens=40,
            stop=stop,
            stream=stream,
            extra_body={"ignore_eos": True},
        )
        chunks = list(r) if stream else [r]
        text = "".join(c.choices[0].text for c in chunks)
        assert text == cut.text and stop not in text
        assert chunks[-1].choices[0].finish_reason == "stop"


def test_seed_reproduces_and_matches_grpc(client, grpc_client):
    def once(**extra):
        return (
            client.chat.completions.create(
                model=TINY_MODEL_ID,
                messages=CHAT,
                temperature=1.0,
                seed=1234,
                max_tokens=16,
                extra_body={"ignore_eos": True, "speculation": "on", **extra},
            )
            .choices[0]
            .message.content
        )

    # speculation pinned: a seeded sample is reproducible for one speculation decision
    # (exact rejection sampling draws its randomness differently from plain sampling), and
    # `auto` may decide differently for the third request than for the first two
    a, b = once(), once()
    g = grpc_client.generate(
        messages=CHAT,
        temperature=1.0,
        seed=1234,
        max_new_tokens=16,
        ignore_eos=True,
        speculation="on",
    )
    assert a == b == g.text
    assert once(top_k=-1) == a  # vLLM's "off"


def test_route_and_speculation_by_header_and_body(client):
    def spec(**kw):
        r = client.completions.create(model=TINY_MODEL_ID, prompt="abc", max_tokens=4, **kw)
        return r.model_extra

    assert spec(extra_headers={"x-speculation": "off"})["speculation"]["reason"] == "off:client"
    assert spec(extra_body={"speculation": "off"})["speculation"]["reason"] == "off:client"
    by_header = spec(extra_headers={"x-route": "batch"})
    assert by_header["route"] == "batch" and by_header["speculation"]["reason"] == "off:policy"
    assert spec(extra_body={"route": "batch"})["route"] == "batch"
    unknown = spec(extra_body={"route": "nope"})
    assert unknown["route"] == "default" and "nope" in unknown["warnings"][0]


def test_the_model_name_may_be_an_alias(client):
    r = client.completions.create(model="tiny-alias", prompt="abc", max_tokens=2)
    assert r.model == TINY_MODEL_ID


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
    assert http("GET", f"{url(cluster, 0)}/health").status_code == 200  # probes need no token


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


# the 100,000-deep body recurses the door's thread to its limit: a finalizer the garbage
# collector happens to run there (of some earlier test's object) cannot even report its
# RecursionError, which pytest would count against this test
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
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
