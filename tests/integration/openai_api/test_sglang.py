"""SGLang's native endpoints on the door (router/sglang_http.py), on the tiny cluster:
/generate answers as SGLang does, greedy the same as the OpenAI door from text or ids and
the same with speculation on and off; a batch, n and a stop are answered in SGLang's
shape; the stream's last event is the whole; log-probabilities, the prompt's too, are the
OpenAI door's; SGLang's clients' fields are taken at the values that ask for nothing;
structural tags and cache salts are the OpenAI door's; the token guards it and bad bodies
are refused naming the field."""

import json
import re
import urllib.request

import pytest

from tests.cluster import TINY_MODEL_ID, char_tokenizer
from tests.integration.openai_api.door import http, post_json, url, wait_for

GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}


def generate(cluster, body: dict, headers=None, base=None):
    r = post_json(f"{base or cluster.http}/generate", body, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("speculation", ["on", "off"])
def test_greedy_generate_is_the_openai_doors_from_text_or_ids(cluster, speculation):
    body = {"text": "def f(x):", "sampling_params": GREEDY}
    out = generate(cluster, body, headers={"x-speculation": speculation})
    openai_body = {"model": TINY_MODEL_ID, "prompt": "def f(x):", "max_tokens": 12}
    openai_body |= {"temperature": 0, "ignore_eos": True, "return_token_ids": True}
    choice = post_json(f"{cluster.http}/v1/completions", openai_body).json()["choices"][0]
    assert out["text"] == choice["text"] and out["output_ids"] == choice["token_ids"]
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (9, 12)
    assert meta["e2e_latency"] > 0 and meta["id"]
    # speculation told as SGLang's speculative decoding tells it
    if speculation == "on":
        assert meta["spec_verify_ct"] > 0
        assert meta["spec_proposed_drafts"] >= meta["spec_accepted_drafts"] >= 0
        assert (
            meta["spec_accept_length"] == 1 + meta["spec_accepted_drafts"] / meta["spec_verify_ct"]
        )
    else:
        assert "spec_verify_ct" not in meta
    # the same prompt as ids
    prompt_ids = char_tokenizer()("def f(x):")["input_ids"]
    ids = generate(cluster, {"input_ids": prompt_ids, "sampling_params": GREEDY})
    assert ids["output_ids"] == out["output_ids"] and ids["text"] == out["text"]


def test_a_batch_n_and_a_stop_answer_in_sglangs_shape(cluster):
    whole = generate(cluster, {"text": "abc", "sampling_params": GREEDY})
    batch = generate(
        cluster,
        {"text": ["abc", "xyz"], "sampling_params": [GREEDY, {**GREEDY, "max_new_tokens": 3}]},
    )
    assert isinstance(batch, list) and [b["meta_info"]["completion_tokens"] for b in batch] == [
        12,
        3,
    ]
    assert batch[0]["text"] == whole["text"]
    n = generate(cluster, {"text": "abc", "sampling_params": {**GREEDY, "n": 3}, "rid": None})
    assert [x["text"] for x in n] == [whole["text"]] * 3  # greedy: n alike
    word = whole["text"][4:6]
    cut = generate(cluster, {"text": "abc", "sampling_params": {**GREEDY, "stop": word}})
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": word}
    assert cut["text"] == whole["text"][: whole["text"].index(word)]
    kept = {**GREEDY, "stop": word, "no_stop_trim": True}
    assert generate(cluster, {"text": "abc", "sampling_params": kept})["text"].endswith(word)
    named = generate(cluster, {"text": "abc", "sampling_params": GREEDY, "rid": "mine"})
    assert named["meta_info"]["id"] == "mine"


def test_the_stream_ends_with_the_whole(cluster):
    body = {"text": "abc", "sampling_params": GREEDY, "stream": True}
    r = post_json(f"{cluster.http}/generate", body)
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    lines = [line[6:] for line in r.text.split("\n\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    events = [json.loads(line) for line in lines[:-1]]
    whole = generate(cluster, {"text": "abc", "sampling_params": GREEDY})
    assert events[-1]["text"] == whole["text"] and events[-1]["output_ids"] == whole["output_ids"]
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])
    so_far = [len(e["output_ids"]) for e in events]
    assert so_far == sorted(so_far) and len(events) > 1  # each event all so far
    assert all(whole["text"].startswith(e["text"]) for e in events)


def test_log_probabilities_are_the_openai_doors(cluster):
    body = {"text": "abc", "sampling_params": GREEDY, "return_logprob": True}
    out = generate(cluster, {**body, "top_logprobs_num": 2, "return_text_in_logprobs": True})
    openai_body = {"model": TINY_MODEL_ID, "prompt": "abc", "max_tokens": 12, "logprobs": 2}
    openai_body |= {"temperature": 0, "ignore_eos": True}
    lp = post_json(f"{cluster.http}/v1/completions", openai_body).json()["choices"][0]["logprobs"]
    chosen = out["meta_info"]["output_token_logprobs"]
    assert [c[1] for c in chosen] == out["output_ids"]
    assert [c[0] for c in chosen] == pytest.approx(lp["token_logprobs"])
    assert [c[2] for c in chosen] == lp["tokens"]
    top = out["meta_info"]["output_top_logprobs"]
    assert [{t[2]: t[0] for t in pos} for pos in top] == [
        pytest.approx(d) for d in lp["top_logprobs"]
    ]
    plain = generate(cluster, body)["meta_info"]
    assert plain["output_token_logprobs"][0][2] is None and "output_top_logprobs" not in plain


def test_the_token_guards_it_and_bad_bodies_are_refused(cluster):
    secured = url(cluster, 0)
    assert post_json(f"{secured}/generate", {"text": "abc"}).status_code == 401
    assert http("GET", f"{secured}/model_info").status_code == 401
    assert http("POST", f"{secured}/reset_prefix_cache").status_code == 401
    assert http("GET", f"{secured}/flush_cache").status_code == 401
    assert http("GET", f"{secured}/get_load").status_code == 401
    assert http("POST", f"{url(cluster, 1)}/flush_cache").status_code == 200  # none to reset
    info = http("GET", f"{cluster.http}/get_model_info").json()
    assert info["is_generation"] is True and info["tokenizer_path"] == TINY_MODEL_ID
    server = http("GET", f"{cluster.http}/get_server_info").json()
    assert server["tokenizer_path"] == TINY_MODEL_ID
    assert http("GET", f"{cluster.http}/health_generate").status_code == 200
    assert http("GET", f"{url(cluster, 1)}/health_generate").status_code == 503  # no replica
    for body, param in [
        ({"sampling_params": GREEDY}, "text"),
        ({"text": "a", "input_ids": [1]}, "text"),
        ({"text": "a", "sampling_params": {"max_new_token": 4}}, "sampling_params.max_new_token"),
        ({"text": "a", "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
        ({"text": ["a", "b"], "sampling_params": [GREEDY]}, "sampling_params"),
        ({"text": "a", "return_logprob": True, "logprob_start_len": 3}, "logprob_start_len"),
        ({"text": "a", "lora_path": "x"}, "lora_path"),
        ({"text": ["a", "b"], "stream": True}, "stream"),
        ({"text": "a", "sampling_params": {"regex": "(", "max_new_tokens": 2}}, None),
    ]:
        r = post_json(f"{cluster.http}/generate", body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, (body, r.text)


def test_the_prompts_log_probabilities_from_logprob_start_len(cluster):
    """As SGLang gives them: one per prompt token from logprob_start_len, the first without
    one, the rest the OpenAI door's `echo` log-probabilities; `max_new_tokens: 0` answers
    the prompt alone."""
    openai_body = {"model": TINY_MODEL_ID, "prompt": "abcdef", "max_tokens": 1, "logprobs": 2}
    openai_body |= {"temperature": 0, "echo": True}
    echo = post_json(f"{cluster.http}/v1/completions", openai_body).json()["choices"][0]
    prompt_len = len(char_tokenizer()("abcdef")["input_ids"])
    expected = echo["logprobs"]["token_logprobs"][:prompt_len]
    expected_top = echo["logprobs"]["top_logprobs"][:prompt_len]
    asked = {"return_logprob": True, "top_logprobs_num": 2, "return_text_in_logprobs": True}
    for start in (0, 3, prompt_len):
        body = {"text": "abcdef", "sampling_params": GREEDY, "logprob_start_len": start, **asked}
        meta = generate(cluster, body)["meta_info"]
        given = meta["input_token_logprobs"]
        assert len(given) == prompt_len - start
        if start < prompt_len:
            assert given[0][0] is None and meta["input_top_logprobs"][0] is None
            assert [g[0] for g in given[1:]] == pytest.approx(expected[start + 1 :])
            # the door's echo also lists the prompt's own token, where it is not in the top 2
            tops = [{t[2]: t[0] for t in pos} for pos in meta["input_top_logprobs"][1:]]
            for ours, door in zip(tops, expected_top[start + 1 :], strict=True):
                assert len(ours) == 2 and ours == pytest.approx({k: door[k] for k in ours})
        assert len(meta["output_token_logprobs"]) == 12  # the output's as before
    ids = char_tokenizer()("abcdef")["input_ids"]
    only = {"max_new_tokens": 0}
    body = {"input_ids": ids, "sampling_params": only, "return_prompt_token_ids": True}
    out = generate(cluster, {**body, "return_logprob": True, "logprob_start_len": 0})
    assert (out["text"], out["output_ids"], out["prompt_token_ids"]) == ("", [], ids)
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    assert (meta["completion_tokens"], meta["output_token_logprobs"]) == (0, [])
    assert [g[0] for g in meta["input_token_logprobs"][1:]] == pytest.approx(expected[1:])


def test_sglangs_clients_fields_are_taken_where_they_ask_for_nothing(cluster):
    """sglang.bench_serving's body (and a rollout client's hints) is served as a plain
    one; each of those fields asking for something specd does not do is refused, naming
    it."""
    plain = generate(cluster, {"text": "abc", "sampling_params": GREEDY})
    bench = {"text": "abc", "sampling_params": GREEDY, "stream": False, "lora_path": None}
    bench |= {"return_logprob": False, "return_routed_experts": False}
    bench |= {"logprob_start_len": -1, "image_data": None, "routed_dp_rank": 0}
    bench |= {"return_hidden_states": False, "log_metrics": True, "routing_key": "k"}
    bench |= {"priority": 0, "custom_labels": {"team": "a"}, "lora_path": [None]}
    assert generate(cluster, bench)["text"] == plain["text"]
    for field, value in [
        ("return_routed_experts", True),
        ("image_data", "data:image/png;base64,AAAA"),
        ("lora_path", ["adapter"]),
        ("token_ids_logprob", [1, 2]),
        ("routed_dp_rank", 1),
        ("priority", 2),
        ("return_hidden_states", True),
        ("return_routed_expert", False),  # no such field
    ]:
        r = post_json(f"{cluster.http}/generate", {"text": "abc", field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, r.text)
    r = post_json(f"{cluster.http}/generate", {"text": "a", "sampling_params": {"stop_regex": "x"}})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "sampling_params.stop_regex"


def test_structural_tags_and_cache_salts_are_the_openai_doors(cluster):
    """sampling_params.structural_tag (JSON text) constrains as the OpenAI door's
    response_format does; extra_key and cache_salt keep a prefix cache of their own (the
    tiny cluster's verifiers keep none, so the salted request is only checked to be
    served alike)."""
    tag = {"begin": "a", "schema": {"type": "integer"}, "end": "!"}
    tags = {"structures": [tag], "triggers": ["a"]}
    sampling = {**GREEDY, "max_new_tokens": 24, "structural_tag": json.dumps(tags)}
    out = generate(cluster, {"text": "abc", "sampling_params": sampling})
    openai_body = {"model": TINY_MODEL_ID, "prompt": "abc", "max_tokens": 24, "temperature": 0}
    openai_body |= {"ignore_eos": True}
    openai_body["response_format"] = {"type": "structural_tag", **tags}
    choice = post_json(f"{cluster.http}/v1/completions", openai_body).json()["choices"][0]
    assert out["text"] == choice["text"]
    salted = {"text": "abc", "sampling_params": sampling, "extra_key": "x", "cache_salt": "y"}
    assert generate(cluster, salted)["text"] == out["text"]
    bad = {**sampling, "structural_tag": "{not json"}
    r = post_json(f"{cluster.http}/generate", {"text": "abc", "sampling_params": bad})
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.structural_tag"
    both = {**sampling, "regex": "[0-9]+"}
    r = post_json(f"{cluster.http}/generate", {"text": "abc", "sampling_params": both})
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params"


def test_the_bodies_sglangs_model_gateway_forwards_are_served(cluster):
    """SGLang's Model Gateway (sglang-router's `smg`) forwards each request with SGLang's
    own fields at their defaults (these bodies are what it sent a worker): served as the
    plain ones are. SGLang's served fields act as vLLM's: `no_stop_trim` as
    include_stop_str_in_output, `regex` and `ebnf` as guided_regex and a GBNF grammar;
    the others are refused, naming the field, where they ask for something."""
    chat = {"model": TINY_MODEL_ID, "messages": [{"role": "user", "content": "abc"}]}
    chat |= {"max_completion_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    completion = {"model": TINY_MODEL_ID, "prompt": "abc", "max_tokens": 12}
    completion |= {"temperature": 0.0, "ignore_eos": True}
    gateway = {"no_stop_trim": False, "skip_special_tokens": True}
    gateway |= {"return_hidden_states": False}
    forwarded = [
        ("/v1/chat/completions", chat, {**gateway, "logprobs": False, "stream": False}),
        ("/v1/chat/completions", chat, {"continue_final_message": False}),
        ("/v1/chat/completions", chat, {"separate_reasoning": True, "stream_reasoning": True}),
        ("/v1/completions", completion, {**gateway, "echo": False, "stream": False}),
        ("/v1/completions", completion, {"priority": None, "rid": "r1", "custom_labels": {}}),
        ("/generate", {"text": "abc", "sampling_params": GREEDY}, {"model": None}),
    ]
    for path, body, extra in forwarded:
        plain, sent = (post_json(f"{cluster.http}{path}", b) for b in (body, {**body, **extra}))
        assert sent.status_code == 200, (path, extra, sent.text)
        assert _text(sent.json()) == _text(plain.json()), (path, extra)
    whole = _text(post_json(f"{cluster.http}/v1/completions", completion).json())
    word = whole[4:6]
    for kept in ({"no_stop_trim": True}, {"include_stop_str_in_output": True}):
        cut = post_json(f"{cluster.http}/v1/completions", {**completion, "stop": word, **kept})
        assert _text(cut.json()) == whole[: whole.index(word)] + word, kept
    shaped = {}
    for field, value in [
        ("regex", "[0-9]+"),
        ("guided_regex", "[0-9]+"),
        ("ebnf", 'root ::= [0-9]+ "!"'),
        ("grammar", 'root ::= [0-9]+ "!"'),
    ]:
        r = post_json(f"{cluster.http}/v1/completions", {**completion, field: value})
        assert r.status_code == 200, (field, r.text)
        shaped[field] = _text(r.json())
    assert re.fullmatch("[0-9]+", shaped["regex"]) and shaped["regex"] == shaped["guided_regex"]
    assert re.fullmatch("[0-9]+!?", shaped["ebnf"]) and shaped["ebnf"] == shaped["grammar"]
    salted = post_json(f"{cluster.http}/v1/completions", {**completion, "extra_key": "x"})
    assert _text(salted.json()) == whole
    for field, value in [
        ("separate_reasoning", False),
        ("return_hidden_states", True),
        ("stop_regex", "[0-9]"),
        ("lora_path", "adapter"),
        ("ebnf", "root ::= ("),
        ("no_such_field", 1),
    ]:
        r = post_json(f"{cluster.http}/v1/chat/completions", {**chat, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, r.text)


def _text(answer: dict) -> str:
    """An answer's text, whichever endpoint gave it."""
    if "choices" not in answer:
        return answer["text"]
    choice = answer["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


def test_get_load_tells_each_replicas_requests_and_tokens_as_sglangs_gateway_reads_them(cluster):
    """GET /get_load, SGLang's per-rank list (its Model Gateway balances on `num_tokens`):
    one entry per replica, a request counted with its KV tokens while it streams, and
    nothing held once every request ended; vLLM's GET /load counts it alike."""

    def idle(loads: list[dict]) -> bool:
        return len(loads) == 2 and sum(x["num_reqs"] for x in loads) == 0

    # the earlier tests' requests gone from the replicas' reports (each up to 100 ms old)
    loads = wait_for(lambda: _loads(cluster), idle)
    assert [x["dp_rank"] for x in loads] == [0, 1]
    assert set(loads[0]) == {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"}
    body = {"text": "abc" * 40, "sampling_params": {**GREEDY, "max_new_tokens": 380}}
    req = urllib.request.Request(
        f"{cluster.http}/generate",
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as stream:
        stream.readline()  # it runs
        # the prompt's 121 tokens in blocks of 4, at least (a report may predate its
        # prefill's end)
        busy = wait_for(lambda: _loads(cluster), lambda ls: sum(x["num_tokens"] for x in ls) >= 124)
        assert sum(x["num_reqs"] for x in busy) == 1
        assert all(x["num_tokens"] % 4 == 0 for x in busy)
        assert _server_load(cluster) == {"server_load": 1}  # vLLM's, the door's own count
        stream.read()
    after = wait_for(lambda: _loads(cluster), idle)
    assert all(x["num_tokens"] == 0 for x in after), after
    assert wait_for(lambda: _server_load(cluster), lambda x: x["server_load"] == 0)


def _server_load(cluster) -> dict:
    """vLLM's GET /load, which asks no token (as vLLM's and /health)."""
    secured = url(cluster, 0)
    assert http("GET", f"{secured}/load").status_code == 200
    return http("GET", f"{cluster.http}/load").json()


def _loads(cluster) -> list[dict]:
    return http("GET", f"{cluster.http}/get_load").json()
