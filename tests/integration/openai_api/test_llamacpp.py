"""llama-server's native endpoints on the door (router/llamacpp_http.py), on the tiny
cluster: /completion answers as llama-server does, greedy the same as the OpenAI door and
the same with speculation on and off; its stream adds up to the whole; n_predict 0
generates nothing; the token guards it; /infill needs FIM tokens (the char tokenizer has
none: the real pair's /infill is checked against llama-server in BENCHMARKS.md); /slots
(router/slots_http.py) shows the replicas' batches and a running request's task."""

import json
import urllib.request

from tests.cluster import TINY_MODEL_ID, char_tokenizer
from tests.integration.openai_api.door import TOKEN, http, post_json, side_door, url, wait_for

GREEDY = {"prompt": "def f(x):", "n_predict": 12, "temperature": 0, "ignore_eos": True}


def test_greedy_completion_is_the_openai_doors_and_speculation_changes_nothing(cluster):
    answers = {}
    for mode in ("on", "off"):
        r = post_json(f"{cluster.http}/completion", {**GREEDY, "speculation": mode})
        assert r.status_code == 200, r.text
        answers[mode] = r.json()
    on, off = answers["on"], answers["off"]
    assert on["content"] == off["content"] and on["tokens_predicted"] == 12
    assert on["stop"] is True and on["stop_type"] == "limit" and on["tokens_predicted"] == 12
    assert on["tokens_evaluated"] == len(GREEDY["prompt"]) and on["prompt"] == GREEDY["prompt"]
    # speculation told as llama-server tells its own
    assert on["timings"]["draft_n"] >= on["timings"]["draft_n_accepted"] >= 0
    assert on["timings"]["draft_n"] > 0
    assert "draft_n" not in off["timings"]
    openai_body = {"model": TINY_MODEL_ID, "prompt": GREEDY["prompt"], "max_tokens": 12}
    openai_body |= {"temperature": 0, "ignore_eos": True}
    r = post_json(f"{cluster.http}/v1/completions", openai_body)
    assert r.json()["choices"][0]["text"] == on["content"]
    # a stop word ends it as llama-server says so
    word = on["content"][4:6]
    r = post_json(f"{cluster.http}/completion", {**GREEDY, "stop": [word]}).json()
    assert r["stop_type"] == "word" and r["stopping_word"] == word
    assert r["content"] == on["content"][: on["content"].index(word)]


def test_the_stream_adds_up_to_the_whole(cluster):
    r = post_json(f"{cluster.http}/completion", {**GREEDY, "stream": True, "return_tokens": True})
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in r.text.split("\n\n") if line.startswith("data: ")]
    whole = post_json(f"{cluster.http}/completion", GREEDY).json()
    assert all(e["stop"] is False for e in events[:-1]) and events[-1]["stop"] is True
    assert "".join(e["content"] for e in events) == whole["content"]
    assert sum((e["tokens"] for e in events[:-1]), []) == events[-1]["tokens"]
    assert len(events[-1]["tokens"]) == 12


def test_n_predict_zero_generates_nothing_and_several_prompts_answer_each(cluster):
    r = post_json(f"{cluster.http}/completion", {"prompt": "abc", "n_predict": 0}).json()
    assert r["content"] == "" and r["tokens_predicted"] == 0 and r["tokens_evaluated"] == 3
    both = post_json(f"{cluster.http}/completion", {**GREEDY, "prompt": ["ab", [70, 71]]})
    assert [a["tokens_evaluated"] for a in both.json()] == [2, 2]


def test_the_token_guards_it_and_bad_bodies_are_refused(cluster):
    secured = url(cluster, 0)
    assert post_json(f"{secured}/completion", GREEDY).status_code == 401
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert post_json(f"{secured}/completion", GREEDY, auth).status_code == 200
    bad = post_json(f"{cluster.http}/completion", {**GREEDY, "repeat_penalty": 1.3})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "repeat_penalty"
    infill = {"input_prefix": "a", "input_suffix": "b"}
    assert post_json(f"{cluster.http}/infill", infill).status_code == 501
    props = http("GET", f"{cluster.http}/props").json()
    assert props["default_generation_settings"]["params"]["temperature"] == 0.8


def test_llama_servers_fields_on_the_chat_endpoint(cluster):
    """llama.vscode's chat edit body (llama-server's sampler fields, no model) is served by
    the chat endpoint; greedy, the same text as a plain chat."""
    from tests.unit.test_llamacpp_schema import CHAT_EDIT

    body = {**CHAT_EDIT, "temperature": 0, "max_tokens": 12, "ignore_eos": True}
    edit = post_json(f"{cluster.http}/v1/chat/completions", body)  # no model: the served one
    assert edit.status_code == 200, edit.text
    assert edit.json()["model"] == TINY_MODEL_ID
    plain = {k: body[k] for k in ("messages", "temperature", "max_tokens", "ignore_eos")}
    plain["model"] = TINY_MODEL_ID
    again = post_json(f"{cluster.http}/v1/chat/completions", plain).json()
    text = edit.json()["choices"][0]["message"]["content"]
    assert text == again["choices"][0]["message"]["content"]
    assert edit.json()["usage"]["completion_tokens"] == 12


def test_llama_servers_tokenize_detokenize_and_apply_template(cluster):
    """llama-server's /tokenize body (`content`, mixed texts and ids, `with_pieces`) in its
    shape beside vLLM's (`prompt`), /detokenize's text as both, and /apply-template's
    prompt the chat's, as its ids decode."""
    ids = [ord(c) - 32 for c in "ab"]
    r = post_json(f"{cluster.http}/tokenize", {"content": "ab"})
    assert r.status_code == 200 and r.json() == {"tokens": ids}, r.text
    mixed = post_json(f"{cluster.http}/tokenize", {"content": ["ab", 5, "c"]}).json()
    assert mixed == {"tokens": [*ids, 5, ord("c") - 32]}
    pieces = post_json(f"{cluster.http}/tokenize", {"content": "ab", "with_pieces": True})
    assert pieces.json() == {"tokens": [{"id": ids[0], "piece": "a"}, {"id": ids[1], "piece": "b"}]}
    vllm = post_json(f"{cluster.http}/tokenize", {"model": TINY_MODEL_ID, "prompt": "ab"})
    assert vllm.json()["tokens"] == ids and vllm.json()["count"] == 2
    text = post_json(f"{cluster.http}/detokenize", {"tokens": ids}).json()
    assert text == {"prompt": "ab", "content": "ab"}
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    prompt = post_json(f"{cluster.http}/apply-template", chat).json()["prompt"]
    tokenized = post_json(f"{cluster.http}/tokenize", {"model": TINY_MODEL_ID, **chat}).json()
    assert prompt == "".join(chr(i + 32) for i in tokenized["tokens"]) and "hi" in prompt
    for body, param in [
        ({"content": "a", "with_pieces": 1}, "with_pieces"),
        ({"content": 5.5}, "content"),
        ({"content": {}}, "content"),
    ]:
        bad = post_json(f"{cluster.http}/tokenize", body)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
    refused = post_json(f"{cluster.http}/apply-template", {"messages": []})
    assert refused.status_code == 400, refused.text


def test_a_servers_default_seed_samples_a_prompt_alike_as_llama_servers_s(cluster):
    """`specd up -s 7` (the router's --default-seed): a sampled request that names no seed
    samples as one naming 7, on llama-server's endpoint and the OpenAI ones; n choices
    take 7 + i; a request's own seed stands."""
    from router.openai_request import SamplingDefaults

    sampled = {"prompt": "abc", "max_tokens": 16, "temperature": 1.0, "ignore_eos": True}
    with side_door(cluster, char_tokenizer(), sampling=SamplingDefaults(seed=7)) as client:
        door = str(client.base_url).removesuffix("/v1/")

        def text(**fields) -> list[str]:
            r = post_json(f"{door}/v1/completions", {**sampled, **fields}).json()
            return [c["text"] for c in r["choices"]]

        assert text() == text() == text(seed=7)
        assert text(n=2) == [*text(seed=7), *text(seed=8)]
        assert text(seed=8) != text(seed=7)
        body = {"prompt": "abc", "n_predict": 16, "ignore_eos": True}  # its own sampling
        llama = [post_json(f"{door}/completion", body).json()["content"] for _ in range(2)]
        seeded = post_json(f"{door}/completion", {**body, "seed": 7}).json()["content"]
        assert llama[0] == llama[1] == seeded
        params = {"max_new_tokens": 16, "temperature": 1.0, "ignore_eos": True}
        sglang = [post_json(f"{door}/generate", {"text": "abc", "sampling_params": params})]
        sglang.append(post_json(f"{door}/generate", {"text": "abc", "sampling_params": params}))
        assert sglang[0].json()["text"] == sglang[1].json()["text"] == text(max_tokens=16)[0]
    # without it, two unseeded requests draw apart
    plain = [post_json(f"{cluster.http}/v1/completions", sampled).json() for _ in range(2)]
    assert plain[0]["choices"][0]["text"] != plain[1]["choices"][0]["text"]


def _slots(address: str, query: str = "") -> list[dict]:
    r = http("GET", f"{address}/slots{query}")
    assert r.status_code == 200, r.text
    return r.json()


def test_slots_are_each_replicas_batch_and_show_a_running_requests_task(cluster):
    """llama-server's GET /slots: a slot per sequence each replica runs at once (two
    replicas of 16), one processing while a request streams, with its task's prompt (the
    tokens found cached and those processed), tokens decoded and left, and parameters; all
    idle again once it ended."""

    def idle(slots: list[dict]) -> bool:
        return len(slots) == 32 and not any(s["is_processing"] for s in slots)

    slots = wait_for(lambda: _slots(cluster.http), idle)
    assert [s["id"] for s in slots] == list(range(32))
    props = http("GET", f"{cluster.http}/props").json()
    assert {s["n_ctx"] for s in slots} == {props["default_generation_settings"]["n_ctx"]}
    assert props["total_slots"] == 32
    assert set(slots[0]) == {"id", "n_ctx", "speculative", "is_processing"}
    body = {**GREEDY, "prompt": "abc" * 20, "n_predict": 300, "seed": 5, "stream": True}
    req = urllib.request.Request(
        f"{cluster.http}/completion",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as stream:
        stream.readline()  # it runs
        busy = [s for s in _slots(cluster.http, "?fail_on_no_slot=1") if s["is_processing"]]
        assert len(busy) == 1, busy
        [task] = busy[0]["next_token"]
        assert busy[0]["n_prompt_tokens"] == 60
        cached = busy[0]["n_prompt_tokens_cache"]
        assert busy[0]["n_prompt_tokens_processed"] == 60 - cached  # (a cached prompt: test_slots)
        assert task["has_next_token"] is True
        assert task["n_decoded"] >= 1 and task["n_decoded"] + task["n_remain"] == 300
        params = busy[0]["params"]
        assert (params["n_predict"], params["seed"], params["temperature"]) == (300, 5, 0.0)
        events = [line for line in stream.read().decode().split("\n") if line.startswith("data: ")]
        assert json.loads(events[-1][6:])["tokens_cached"] == cached  # as the answer says
    wait_for(lambda: _slots(cluster.http), idle)


def test_slots_want_the_token_and_refuse_what_specd_does_not_do(cluster):
    secured, empty = url(cluster, 0), url(cluster, 1)
    assert http("GET", f"{secured}/slots").status_code == 401
    assert http("POST", f"{secured}/slots/0?action=save").status_code == 401
    given = {"Authorization": f"Bearer {TOKEN}"}
    assert len(http("GET", f"{secured}/slots", headers=given).json()) == 32
    r = post_json(f"{cluster.http}/slots/0?action=save", {"filename": "a.bin"})
    assert r.status_code == 501 and "--slot-save-path" in r.json()["error"]["message"]
    assert _slots(empty) == []  # no replica: no slot, none idle
    r = http("GET", f"{empty}/slots?fail_on_no_slot=1")
    assert r.status_code == 503 and r.json()["error"]["message"] == "no slot available"
    with side_door(cluster, char_tokenizer(), slots=False) as client:
        r = http("GET", f"{str(client.base_url).removesuffix('/v1/')}/slots")
    assert r.status_code == 501 and "--slots" in r.json()["error"]["message"]
