"""The door's sampling fields beyond the basics: log-probabilities, `n` choices,
presence and frequency penalties and logit_bias, each the same with speculation on and
off; a reasoning model's thinking read apart, and a constraint held after it."""

import math

import openai
import pytest

from tests.cluster import TINY_MODEL_ID, char_tokenizer
from tests.integration.openai_api.door import (
    CHAT,
    completion,
    completion_text,
    post_json,
    side_door,
)
from tests.integration.test_services import wait_idle


def test_logprobs_on_both_endpoints_are_grpcs_and_the_same_with_speculation_on(client, grpc_client):
    """The target's log-probabilities: equal with speculation on and off (token for token,
    value for value), in each endpoint's shape, whole and streamed."""
    ask = dict(messages=CHAT, max_new_tokens=16, ignore_eos=True, logprobs=3)
    on, off = (grpc_client.generate(**ask, speculation=s) for s in ("on", "off"))
    assert on.speculation.drafted > 0
    assert list(on.token_ids) == list(off.token_ids) and list(on.logprobs) == list(off.logprobs)
    assert len(on.logprobs) == len(on.token_ids) == 16
    text = char_tokenizer().decode
    extra = {"ignore_eos": True, "speculation": "on"}
    chat = dict(model=TINY_MODEL_ID, messages=CHAT, temperature=0, max_tokens=16, extra_body=extra)
    whole = client.chat.completions.create(**chat, logprobs=True, top_logprobs=3)
    content = whole.choices[0].logprobs.content
    assert [c.token for c in content] == [text([i]) for i in on.token_ids]
    assert "".join(c.token for c in content) == whole.choices[0].message.content
    assert [c.logprob for c in content] == pytest.approx([lp.logprob for lp in on.logprobs])
    assert [c.bytes for c in content] == [list(c.token.encode()) for c in content]
    for c, lp in zip(content, on.logprobs, strict=True):
        assert [t.token for t in c.top_logprobs] == [text([i]) for i in lp.top_ids]
        assert [t.logprob for t in c.top_logprobs] == pytest.approx(list(lp.top_logprobs))
    chunks = list(
        client.chat.completions.create(**chat, logprobs=True, top_logprobs=3, stream=True)
    )
    streamed = [
        c for ch in chunks if ch.choices[0].logprobs for c in ch.choices[0].logprobs.content
    ]
    assert [c.model_dump() for c in streamed] == [c.model_dump() for c in content]
    plain = client.chat.completions.create(**chat)
    assert plain.choices[0].logprobs is None
    named = {**extra, "return_tokens_as_token_ids": True}  # vLLM's, for exact ids
    by_id = (
        client.chat.completions.create(
            **{**chat, "extra_body": named}, logprobs=True, top_logprobs=3
        )
        .choices[0]
        .logprobs.content
    )
    assert [c.token for c in by_id] == [f"token_id:{i}" for i in on.token_ids]
    assert [t.token for t in by_id[0].top_logprobs] == [
        f"token_id:{i}" for i in on.logprobs[0].top_ids
    ]

    prompt = dict(
        model=TINY_MODEL_ID, prompt="abcabc", temperature=0, max_tokens=16, extra_body=extra
    )
    g = grpc_client.generate("abcabc", max_new_tokens=16, ignore_eos=True, logprobs=2)
    for stream in (False, True):
        r = client.completions.create(**prompt, logprobs=2, stream=stream)
        parts = [c.choices[0].logprobs for c in (r if stream else [r]) if c.choices[0].logprobs]
        tokens = [t for p in parts for t in p.tokens]
        assert tokens == [text([i]) for i in g.token_ids]
        assert [v for p in parts for v in p.token_logprobs] == pytest.approx(
            [lp.logprob for lp in g.logprobs]
        )
        assert [o for p in parts for o in p.text_offset] == list(range(16))  # a char a token
        for top, token, lp in zip(
            (t for p in parts for t in p.top_logprobs), tokens, g.logprobs, strict=True
        ):
            assert top[token] == pytest.approx(lp.logprob)  # the emitted token's, always
            assert set(top) == {token} | {text([i]) for i in lp.top_ids}


def test_echo_returns_the_prompt_and_its_logprobs_as_vllm(client, grpc_client):
    """`echo` with `logprobs` (lm-eval's loglikelihood request): the prompt's text before
    the completion's, and its tokens' log-probabilities before theirs, the first token's
    None; the prompt's equal gRPC's prompt_logprobs, with speculation on and off; the
    same streamed."""
    prompt, text = "def add(a, b):", char_tokenizer().decode
    grpc = {
        s: grpc_client.generate(
            prompt, max_new_tokens=8, prompt_logprobs=2, logprobs=2, speculation=s
        )
        for s in ("on", "off")
    }
    assert list(grpc["on"].prompt_logprobs) == list(grpc["off"].prompt_logprobs)
    assert len(grpc["on"].prompt_logprobs) == len(prompt) - 1
    ask = dict(model=TINY_MODEL_ID, prompt=prompt, temperature=0, max_tokens=8, echo=True)
    whole = client.completions.create(**ask, logprobs=2, extra_body={"speculation": "on"})
    choice = whole.choices[0]
    assert choice.text == prompt + grpc["on"].text
    lp = choice.logprobs
    assert lp.tokens == list(prompt) + [text([i]) for i in grpc["on"].token_ids]
    want = [None, *(x.logprob for x in grpc["on"].prompt_logprobs)]
    want += [x.logprob for x in grpc["on"].logprobs]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(want[1:])
    assert all(len(t) >= 2 for t in lp.top_logprobs[1:])  # the top 2 beside the token
    assert lp.text_offset == list(range(len(lp.tokens)))  # a character a token
    chunks = list(client.completions.create(**ask, logprobs=2, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    streamed = [
        t
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.token_logprobs
    ]
    assert streamed[0] is None and streamed[1:] == pytest.approx(lp.token_logprobs[1:])
    scored = client.completions.create(**{**ask, "max_tokens": 0}, logprobs=2)  # the prompt only
    assert scored.choices[0].text == prompt and scored.choices[0].finish_reason == "length"
    assert scored.choices[0].logprobs.token_logprobs == lp.token_logprobs[: len(prompt)]
    assert scored.usage.completion_tokens == 0
    chunks = list(client.completions.create(**{**ask, "max_tokens": 0}, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == prompt
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(**{**ask, "echo": False, "max_tokens": 0})
    assert err.value.body["param"] == "max_tokens"
    plain = client.completions.create(**ask)  # echo alone: the text, no log-probabilities
    assert plain.choices[0].text == choice.text and plain.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(**ask, suffix="x")
    assert err.value.body["param"] == "echo"


def test_prompt_logprobs_in_vllms_shape(cluster, grpc_client):
    """vLLM's `prompt_logprobs`: None for the first token, then at each position the
    prompt's token (its log-probability and rank as gRPC's) and the top k by rank; a
    completion's in each choice, a chat's at the top level; `echo`'s top tokens still its
    own count."""
    prompt = "def add(a, b):"
    grpc = grpc_client.generate(prompt, max_new_tokens=2, prompt_logprobs=3).prompt_logprobs
    body = {"model": TINY_MODEL_ID, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    r = post_json(f"{cluster.http}/v1/completions", {**body, "prompt_logprobs": 2, "n": 2})
    assert r.status_code == 200, r.text
    ids = char_tokenizer().encode(prompt)
    for choice in r.json()["choices"]:
        got = choice["prompt_logprobs"]
        assert got[0] is None and len(got) == len(ids)
        for token, at, want in zip(ids[1:], got[1:], grpc, strict=True):
            mine = at[str(token)]
            assert mine["logprob"] == pytest.approx(want.logprob) and mine["rank"] == want.rank
            assert mine["decoded_token"] == char_tokenizer().decode([token])
            tops = [(int(i), e["rank"]) for i, e in at.items() if e["rank"] <= 2]
            assert sorted(tops, key=lambda t: t[1]) == list(
                zip(want.top_ids[:2], [1, 2], strict=True)
            )
            assert (want.rank == 1) == (want.top_ids[0] == token) and len(at) <= 3
    echo = {**body, "echo": True, "logprobs": 1, "prompt_logprobs": 3}
    both = post_json(f"{cluster.http}/v1/completions", echo).json()["choices"][0]
    assert max(len(t) for t in both["logprobs"]["top_logprobs"][1:]) == 2  # echo's own 1
    assert max(len(at) for at in both["prompt_logprobs"][1:]) == 4
    chat = {"model": TINY_MODEL_ID, "messages": CHAT, "max_tokens": 2, "prompt_logprobs": 0}
    r = post_json(f"{cluster.http}/v1/chat/completions", chat).json()
    assert len(r["prompt_logprobs"]) == r["usage"]["prompt_tokens"]
    assert all(len(at) == 1 for at in r["prompt_logprobs"][1:])


def test_a_constrained_requests_logprobs_are_over_what_its_grammar_allows(cluster):
    """As vLLM's sampler gets them: after the grammar's mask, so the allowed tokens' mass
    is 1 and a forbidden one reads -9999.0 (never -Infinity, which is not JSON)."""
    body = {
        "model": TINY_MODEL_ID,
        "prompt": "def f(x):",
        "max_tokens": 8,
        "temperature": 0,
        "guided_regex": "[abc]{8}",
        "logprobs": 5,
    }
    r = post_json(f"{cluster.http}/v1/completions", body)
    assert r.status_code == 200, r.text
    assert b"Infinity" not in r.body and b"NaN" not in r.body
    logprobs = r.json()["choices"][0]["logprobs"]
    assert set(logprobs["tokens"]) <= set("abc") and len(logprobs["tokens"]) == 8
    for top in logprobs["top_logprobs"]:
        allowed = {t: v for t, v in top.items() if v > -9999.0}
        assert set(allowed) == set("abc")
        assert sum(math.exp(v) for v in allowed.values()) == pytest.approx(1.0, abs=1e-4)
        assert sorted(v for t, v in top.items() if t not in allowed) == [-9999.0] * 2


def test_presence_and_frequency_penalties_change_the_output_alike_with_speculation(client):
    """OpenAI's penalties reach the verifier: greedy output changes under them, and is
    the same with speculation on and off."""

    plain = completion_text(client, "off")
    for penalties in ({"presence_penalty": 2.0}, {"frequency_penalty": 1.5}):
        off = completion_text(client, "off", **penalties)
        assert off != plain and completion_text(client, "on", **penalties) == off
    with pytest.raises(openai.BadRequestError) as err:
        completion_text(client, "off", presence_penalty=2.5)
    assert err.value.body["param"] == "presence_penalty"


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        ("chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("chat/completions", {"logprobs": 1}, "logprobs"),
        ("completions", {"logprobs": 21}, "logprobs"),
        ("completions", {"logprobs": -1}, "logprobs"),
        ("completions", {"logprobs": True}, "logprobs"),
        ("completions", {"prompt_logprobs": 21}, "prompt_logprobs"),
        ("chat/completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ],
)
def test_logprobs_out_of_range_are_refused(cluster, path, fields, param):
    body = {"model": TINY_MODEL_ID, "max_tokens": 2, **fields}
    body.update({"messages": CHAT} if path.startswith("chat") else {"prompt": "x"})
    r = post_json(f"{cluster.http}/v1/{path}", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    if param == "top_logprobs" and "logprobs" not in fields:  # 0 asks for nothing (vLLM)
        r = post_json(f"{cluster.http}/v1/{path}", {**body, "top_logprobs": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None, r.text


def test_n_choices_are_seeded_requests_side_by_side(client):
    """n = 3 at a seed: choice i is what the request alone gives at seed + i, whole and
    streamed; prompt tokens count once, completion tokens for every choice."""
    extra = {"ignore_eos": True, "speculation": "on", "return_token_ids": True}
    ask = dict(model=TINY_MODEL_ID, messages=CHAT, temperature=1.0, max_tokens=12, extra_body=extra)
    alone = [client.chat.completions.create(**ask, seed=40 + i).choices[0] for i in range(3)]
    whole = client.chat.completions.create(**ask, seed=40, n=3)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    texts = [c.message.content for c in whole.choices]
    assert texts == [c.message.content for c in alone] and len(set(texts)) == 3
    assert whole.usage.completion_tokens == 36
    assert whole.usage.prompt_tokens == client.chat.completions.create(**ask).usage.prompt_tokens
    assert all(c.model_extra["speculation"]["drafted"] > 0 for c in whole.choices)
    chunks = list(
        client.chat.completions.create(
            **ask, seed=40, n=3, stream=True, stream_options={"include_usage": True}
        )
    )
    *body, usage = chunks
    assert usage.choices == [] and usage.usage.completion_tokens == 36
    by_choice = {i: [c.choices[0] for c in body if c.choices[0].index == i] for i in range(3)}
    for i, parts in by_choice.items():
        assert parts[0].delta.role == "assistant"  # each choice opens with its role
        assert "".join(p.delta.content or "" for p in parts) == texts[i]
        assert [p.finish_reason for p in parts][-1] == "length"
        ids = [t for p in parts for t in p.model_extra["token_ids"]]
        assert ids == whole.choices[i].model_extra["token_ids"]
    greedy = client.completions.create(
        model=TINY_MODEL_ID, prompt="abc", temperature=0, max_tokens=8, n=2
    )
    assert greedy.choices[0].text == greedy.choices[1].text


def test_a_logit_bias_bans_and_favours_tokens_alike_with_speculation(client):
    """OpenAI's logit_bias (token ids as strings): -100 bans the plain answer's most
    frequent character, and the biased answer is the same with speculation on and off;
    what is not a token id of this model is refused, naming the field."""

    plain = completion_text(client, "off")
    common = max(set(plain), key=plain.count)
    ban = {str(char_tokenizer()(common)["input_ids"][0]): -100}
    off = completion_text(client, "off", logit_bias=ban)
    assert common not in off and completion_text(client, "on", logit_bias=ban) == off
    for bad in ({"x": 1}, {"5": 101}, {"-1": 1}, {"500": 1}, {"99999999999": 1}):
        with pytest.raises(openai.BadRequestError) as err:
            completion_text(client, "off", logit_bias=bad)
        assert "logit_bias" in err.value.message, bad


def test_allowed_token_ids_keep_the_output_to_them_alike_with_speculation(client):
    """vLLM's allowed_token_ids: the output holds only those tokens (the plain answer's
    characters but its most frequent), the same with speculation on and off; an empty
    list, or an id past the vocabulary, is refused naming the field."""
    plain = completion_text(client, "off")
    common = max(set(plain), key=plain.count)
    kept = sorted(set(plain) - {common})
    allowed = {"allowed_token_ids": [char_tokenizer()(c)["input_ids"][0] for c in kept]}
    off = completion_text(client, "off", extra_body=allowed)
    assert set(off) <= set(kept) and len(off) == 24
    assert completion_text(client, "on", extra_body=allowed) == off
    for bad in ([], [5, 500]):
        with pytest.raises(openai.BadRequestError) as err:
            completion_text(client, "off", extra_body={"allowed_token_ids": bad})
        assert "allowed_token_ids" in err.value.message, bad


def test_bad_words_never_appear_in_the_output_alike_with_speculation(client):
    """vLLM's bad_words: the plain answer's commonest pair of characters, and its
    commonest character after them, never appear in the output; the same with
    speculation on and off (a word is read without its leading spaces, as in vLLM)."""
    plain = completion_text(client, "off")
    pairs = [plain[i : i + 2] for i in range(len(plain) - 1) if " " not in plain[i : i + 2]]
    pair = max(set(pairs), key=pairs.count)
    banned = {"bad_words": [pair]}
    off = completion_text(client, "off", extra_body=banned)
    assert pair in plain and pair not in off and off != plain
    assert completion_text(client, "on", extra_body=banned) == off
    common = max(set(off) - {" "}, key=off.count)
    twice = completion_text(client, "off", extra_body={"bad_words": [pair, common]})
    assert pair not in twice and common not in twice


@pytest.mark.parametrize("n", [0, 129, 1.5])
def test_n_out_of_range_is_refused(cluster, n):
    body = {"model": TINY_MODEL_ID, "prompt": "x", "max_tokens": 2, "n": n}
    r = post_json(f"{cluster.http}/v1/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text


def test_a_client_leaving_n_choices_mid_stream_frees_each(cluster, client, aborts):
    assert wait_idle(cluster)
    stream = client.completions.create(
        model=TINY_MODEL_ID,
        prompt="abc",
        max_tokens=150,  # all three fit the tiny cluster's KV pools at once
        n=3,
        stream=True,
        extra_body={"ignore_eos": True, "speculation": "on"},
    )
    for got, _ in enumerate(stream):
        if got == 5:
            break
    # all three in the verifiers (the cluster's replicas share one model thread: one may
    # wait for the other's work to end)
    assert sum(e.scheduler.batch for e in cluster.engines) == 3
    stream.close()
    assert wait_idle(cluster), "KV blocks or drafter sessions were not released"
    assert len(aborts) == 3, "a choice ran on after its client left"


def test_special_tokens_are_left_out_of_the_text_unless_asked_for(client):
    """The tiny tokenizer's one special token is its unknown, "?" (id 31): favoured by a
    logit bias, it is all the output, shown only with skip_special_tokens false."""
    favour = {"logit_bias": {"31": 100}}
    assert completion(client, "on", **favour).text == ""
    shown = completion(client, "on", skip_special_tokens=False, **favour)
    assert shown.text == "?" * 24 and shown.model_extra["token_ids"] == [31] * 24


def test_a_chat_continues_its_last_message_as_vllm_renders_it(cluster, client):
    """continue_final_message (with add_generation_prompt false): the prompt ends where
    the assistant's partial reply does, and the choice continues it; both true, or a
    template variable that would replace the messages, is refused naming the field."""
    partial = [*CHAT, {"role": "assistant", "content": "abc"}]
    ask = {"model": TINY_MODEL_ID, "messages": partial}
    options = {"add_generation_prompt": False, "continue_final_message": True}
    ids = post_json(f"{cluster.http}/tokenize", {**ask, **options}).json()["tokens"]
    plain = post_json(f"{cluster.http}/tokenize", ask).json()["tokens"]
    abc = char_tokenizer()("abc")["input_ids"]
    assert ids[-3:] == abc and plain[: len(ids)] == ids and len(plain) > len(ids)
    r = client.chat.completions.create(**ask, max_tokens=4, temperature=0, extra_body=options)
    assert r.choices[0].finish_reason == "length" and r.usage.prompt_tokens == len(ids)
    echoed = {**options, "echo": True}  # vLLM's: the reply so far leads the answer
    e = client.chat.completions.create(**ask, max_tokens=4, temperature=0, extra_body=echoed)
    assert e.choices[0].message.content == "abc" + r.choices[0].message.content
    chunks = client.chat.completions.create(
        **ask, max_tokens=4, temperature=0, extra_body=echoed, stream=True
    )
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks)
        == "abc" + r.choices[0].message.content
    )
    user_last = {**ask, "messages": CHAT}  # the last message is not the assistant's
    u = client.chat.completions.create(**user_last, max_tokens=4, temperature=0)
    ue = client.chat.completions.create(
        **user_last, max_tokens=4, temperature=0, extra_body={"echo": True}
    )
    assert ue.choices[0].message.content == u.choices[0].message.content
    for fields, param in [
        ({"continue_final_message": True}, "continue_final_message"),
        ({"chat_template_kwargs": {"messages": []}}, None),
    ]:
        r = post_json(f"{cluster.http}/v1/chat/completions", {**ask, **fields})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.fixture(scope="module")
def thinking(cluster):
    """A door over the same replicas whose router reads Qwen3's thinking apart, and holds
    a constraint from the first token (vLLM's enable_in_reasoning): a regex may force it."""
    fields = dict(reasoning_parser="qwen3", structured_outputs_in_reasoning=True)
    with side_door(cluster, char_tokenizer(), **fields) as client:
        yield client


@pytest.mark.parametrize("speculation", ["off", "on"])
def test_a_reasoning_parser_answers_the_thinking_apart(thinking, speculation):
    """The output forced to "<think>ab</think>cd" (a regex held from the first token):
    reasoning_content "ab" and content "cd", whole and streamed; without the thinking
    where the request says so."""
    ask = dict(
        model=TINY_MODEL_ID,
        messages=CHAT,
        temperature=0,
        max_tokens=40,
        extra_body={"guided_regex": "<think>ab</think>cd", "speculation": speculation},
    )
    message = thinking.chat.completions.create(**ask).choices[0].message
    assert (message.model_extra["reasoning_content"], message.content) == ("ab", "cd")
    deltas = [c.choices[0].delta for c in thinking.chat.completions.create(**ask, stream=True)]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == "ab"
    assert "".join(d.content or "" for d in deltas) == "cd"
    # vLLM's include_reasoning: false answers the content alone, whole and streamed
    ask["extra_body"] |= {"include_reasoning": False}
    message = thinking.chat.completions.create(**ask).choices[0].message
    assert (message.model_extra["reasoning_content"], message.content) == (None, "cd")
    chunks = list(thinking.chat.completions.create(**ask, stream=True))
    deltas = [c.choices[0].delta for c in chunks]
    assert not any(d.model_extra.get("reasoning_content") for d in deltas)
    assert "".join(d.content or "" for d in deltas) == "cd"
    # and no chunk for the thinking: each opens the answer, says some of it, or ends it
    assert all(
        d.role or d.content or c.choices[0].finish_reason
        for c, d in zip(chunks, deltas, strict=True)
    )


@pytest.mark.parametrize("speculation", ["off", "on"])
def test_structured_output_holds_after_the_thinking(cluster, client, speculation):
    """Under deepseek_r1 a schema waits for "</think>", as vLLM's structured output does
    under a reasoning parser: the tiny model's greedy output, which never closes its
    thinking, is its output without the schema, all of it reasoning_content."""
    ask = dict(model=TINY_MODEL_ID, messages=CHAT, temperature=0, max_tokens=24)
    extra = {"ignore_eos": True, "speculation": speculation}
    plain = client.chat.completions.create(**ask, extra_body=extra).choices[0].message.content
    schema = {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}
    json_schema = {"name": "record", "schema": schema}
    fields = dict(response_format={"type": "json_schema", "json_schema": json_schema})
    with side_door(cluster, char_tokenizer(), reasoning_parser="deepseek_r1") as r1:
        choice = r1.chat.completions.create(**ask, **fields, extra_body=extra).choices[0]
        chunks = list(r1.chat.completions.create(**ask, **fields, extra_body=extra, stream=True))
    assert "</think>" not in plain and not plain.lstrip().startswith("{")
    assert choice.message.model_extra["reasoning_content"] == plain
    assert not choice.message.content and choice.finish_reason == "length"
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == plain
