"""The router's OpenAI-compatible HTTP door, driven by the official `openai` SDK (and raw
HTTP where the SDK would refuse to send something), against tiny models on loopback; its
sampling fields beyond the basics are test_sampling's, what a wrong request gets is
test_http_errors's."""

import openai
import pytest

from tests.cluster import CHAT_TEMPLATE, TINY_MODEL_ID, char_tokenizer
from tests.integration.openai_api.door import CHAT, TOKEN, http, post_json, side_door, url


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


def test_tokenizer_info_lets_a_client_tokenize_through_the_server(cluster):
    """vLLM's /tokenizer_info, as lm-evaluation-harness's remote tokenizer reads it: the
    special tokens' text (whose ids it then asks /tokenize for) and the chat template it
    renders chats with itself; the door's token guards it."""
    info = http("GET", f"{cluster.http}/tokenizer_info").json()
    assert info["unk_token"] == "?" and info["chat_template"] == CHAT_TEMPLATE
    tokenizer = char_tokenizer()  # the router's (a transformers tokenizer here)
    assert info["tokenizer_class"] == type(tokenizer).__name__
    ids = post_json(f"{cluster.http}/tokenize", {"prompt": info["unk_token"]}).json()["tokens"]
    assert ids == [tokenizer.unk_token_id]
    secured = f"{url(cluster, 0)}/tokenizer_info"
    assert http("GET", secured).status_code == 401
    assert http("GET", secured, headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200


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
    # as vLLM and the OpenAI API say it: clients read these to shorten and retry
    assert err.value.code == "context_length_exceeded"
    assert f"maximum context length is {context} tokens" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=TINY_MODEL_ID, prompt="def f(x):", max_tokens=context)
    assert err.value.code == "context_length_exceeded"
    assert f"requested {context + 9} tokens (9 in the prompt, {context} in" in err.value.message


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


def test_several_served_names_are_each_listed_and_answered_as_the_first(cluster):
    """vLLM's `--served-model-name coder gpt-4o`: /v1/models lists a card for each name,
    any of them is served, and the answer names the first, as vLLM's does."""
    with side_door(cluster, char_tokenizer(), also_served=("gpt-4o",)) as client:
        cards = client.models.list().data
        assert [c.id for c in cards] == [TINY_MODEL_ID, "gpt-4o"]
        assert cards[1].model_dump()["max_model_len"] == 512  # the same model's card
        assert client.models.retrieve("gpt-4o").id == "gpt-4o"
        r = client.completions.create(model="gpt-4o", prompt="abc", max_tokens=2)
        assert r.model == TINY_MODEL_ID
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="gpt-5", prompt="abc", max_tokens=2)


def test_sagemakers_invocations_serve_a_chat_or_a_completion_by_its_body(cluster, client):
    """vLLM's POST /invocations (SageMaker's door, beside /ping): the same answers as the
    endpoints the bodies are for; a body of neither is refused; the token guards it."""
    chat = {"model": TINY_MODEL_ID, "messages": CHAT, "max_tokens": 6, "temperature": 0}
    completion = {"prompt": "abcabc", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    invoked = post_json(f"{cluster.http}/invocations", chat).json()
    assert invoked["object"] == "chat.completion"
    direct = client.chat.completions.create(**chat)
    assert invoked["choices"][0]["message"]["content"] == direct.choices[0].message.content
    invoked = post_json(f"{cluster.http}/invocations", completion).json()
    assert invoked["object"] == "text_completion"
    direct = client.completions.create(
        model=TINY_MODEL_ID,
        prompt="abcabc",
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert invoked["choices"][0]["text"] == direct.choices[0].text
    neither = post_json(f"{cluster.http}/invocations", {"input": "abc"})
    assert neither.status_code == 400 and "messages" in neither.json()["error"]["message"]
    assert post_json(f"{url(cluster, 0)}/invocations", chat).status_code == 401
    guarded = post_json(
        f"{url(cluster, 0)}/invocations", chat, {"Authorization": f"Bearer {TOKEN}"}
    )
    assert guarded.status_code == 200
