"""What OpenAI's and vLLM's clients send beyond the sampling fields (router/client_fields.py):
OpenAI's service fields accepted without changing the answer, vLLM's request_id naming
it, the chat template's documents and reasoning_effort, and what specd does not do
refused naming the field."""

import json
import random
import time
import urllib.request

import pytest

from specd.config import EngineConfig
from tests.cluster import TINY_MODEL_ID, char_tokenizer, start_cluster
from tests.integration.openai_api.door import CHAT, http, post_json, side_door

ASK = {"model": TINY_MODEL_ID, "messages": CHAT, "temperature": 0, "max_tokens": 12}
COMPLETE = {"model": TINY_MODEL_ID, "prompt": "ab", "max_tokens": 4}
SERVICE = {
    "metadata": {"team": "search"},
    "store": False,
    "service_tier": "auto",
    "prompt_cache_key": "tenant-7",
    "safety_identifier": "hashed-user",
    "modalities": ["text"],
    "prediction": {"type": "content", "content": "def add(a, b):\n    return a + b"},
    "spaces_between_special_tokens": False,
    "priority": 0,
}


def test_openais_service_fields_leave_the_answer_as_it_is(cluster, client):
    plain = client.chat.completions.create(**ASK).choices[0].message.content
    served = client.chat.completions.create(**ASK, extra_body=SERVICE)
    assert served.choices[0].message.content == plain
    completion = post_json(f"{cluster.http}/v1/completions", {**COMPLETE, **SERVICE})
    assert completion.status_code == 200, completion.text


@pytest.mark.parametrize("stream", [False, True])
def test_a_prediction_drafts_the_answer_it_predicts_and_counts_its_tokens(cluster, stream):
    """OpenAI's Predicted Outputs: the answer is the model's either way; the usage says
    how many predicted tokens it took (accepted) and how many it did not (rejected)."""
    url, asked = f"{cluster.http}/v1/chat/completions", {**ASK, "max_tokens": 24}
    plain = post_json(url, {**asked, "speculation": "off"}).json()
    text = plain["choices"][0]["message"]["content"]
    assert "completion_tokens_details" not in plain["usage"]  # no prediction, no count
    for predicted, took in [(text, "all"), ("x" + text[:6] + "yz" + text[6:], "some")]:
        prediction = {"type": "content", "content": [{"type": "text", "text": predicted}]}
        body = {**asked, "speculation": "on", "prediction": prediction}
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
            lines = post_json(url, body).text.split("\n\n")
            events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
            got = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
            usage = events[-1]["usage"]
        else:
            answer = post_json(url, body).json()
            got, usage = answer["choices"][0]["message"]["content"], answer["usage"]
        assert got == text
        counts = usage["completion_tokens_details"]
        accepted, rejected = (
            counts["accepted_prediction_tokens"],
            counts["rejected_prediction_tokens"],
        )
        if took == "all":
            assert accepted > 0 and rejected == 0, counts
        else:  # it starts off the prediction and leaves it once more
            assert accepted > 0 and rejected > 0, counts


def test_a_request_id_names_the_answer_the_header_first(cluster):
    url = f"{cluster.http}/v1/chat/completions"
    named = post_json(url, {**ASK, "request_id": "job-42"}).json()
    assert named["id"] == "chatcmpl-job-42"
    header = post_json(url, {**ASK, "request_id": "job-42"}, {"X-Request-Id": "trace-9"}).json()
    assert header["id"] == "chatcmpl-trace-9"
    completion = post_json(f"{cluster.http}/v1/completions", {**COMPLETE, "request_id": "c1"})
    assert completion.json()["id"] == "cmpl-c1"
    fresh = {post_json(url, ASK).json()["id"] for _ in range(2)}
    assert len(fresh) == 2 and all(i.startswith("chatcmpl-") for i in fresh)


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"priority": 1}, "priority"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"length_penalty": 0.5}, "length_penalty"),
        ({"bad_words": [""]}, "bad_words.0"),
        ({"modalities": ["text", "audio"]}, "modalities.1"),
        ({"service_tier": "fastest"}, "service_tier"),
        ({"prediction": {"type": "content"}}, "prediction.content"),
        ({"request_id": ""}, "request_id"),
    ],
)
def test_what_specd_does_not_do_is_refused_naming_the_field(cluster, fields, param):
    r = post_json(f"{cluster.http}/v1/chat/completions", {**ASK, **fields})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_documents_and_reasoning_effort_reach_the_chat_template(cluster):
    """As vLLM hands them on: template variables of their names, which the request's
    chat_template_kwargs may still set."""
    tokenizer = char_tokenizer()
    tokenizer.chat_template = (
        "{% for d in documents or [] %}[{{ d.title }}: {{ d.text }}]{% endfor %}"
        "({{ reasoning_effort }}){% for m in messages %}{{ m.content }}{% endfor %}"
    )
    docs = [{"title": "Lyon", "text": "rain"}, {"title": "Nice", "text": "sun"}]
    with side_door(cluster, tokenizer) as door:
        url = f"{door.base_url}".removesuffix("v1/") + "tokenize"
        asked = {"model": TINY_MODEL_ID, "messages": CHAT, "documents": docs}
        for fields, text in [
            ({"reasoning_effort": "low"}, "[Lyon: rain][Nice: sun](low)def add(a, b):"),
            ({"chat_template_kwargs": {"reasoning_effort": "high"}}, "(high)"),
        ]:
            r = post_json(url, {**asked, **fields})
            assert r.status_code == 200, r.text
            assert text in tokenizer.decode(r.json()["tokens"])


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(cluster, client):
    """vLLM's truncate_prompt_tokens: k keeps the last k (the answer is the cut prompt's,
    token for token), -1 what the context holds (here the whole prompt)."""
    ask = dict(model=TINY_MODEL_ID, max_tokens=8, temperature=0)
    cut = client.completions.create(
        **ask, prompt="zzzzabcabc", extra_body={"truncate_prompt_tokens": 6}
    )
    short = client.completions.create(**ask, prompt="abcabc")
    assert cut.usage.prompt_tokens == 6 and cut.choices[0].text == short.choices[0].text
    chat = client.chat.completions.create(
        **ask, messages=CHAT, extra_body={"truncate_prompt_tokens": 5}
    )
    assert chat.usage.prompt_tokens == 5
    whole = client.chat.completions.create(**ask, messages=CHAT)
    context = client.chat.completions.create(
        **ask, messages=CHAT, extra_body={"truncate_prompt_tokens": -1}
    )
    assert context.usage.prompt_tokens == whole.usage.prompt_tokens > 5
    r = post_json(
        f"{cluster.http}/v1/completions", {**ask, "prompt": "ab", "truncate_prompt_tokens": -2}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"


@pytest.fixture(scope="module")
def cached_replicas(tiny_pair):
    engine = EngineConfig(num_blocks=256, block_size=4, prefix_cache="on")  # fp32: auto is off
    c = start_cluster(*tiny_pair, replicas=2, engine_config=engine, drafter_prefix_cache=True)
    yield c
    c.close()


def test_a_repeated_prompt_finds_its_cache_on_every_repeat_under_its_salt(cached_replicas):
    """Two replicas: the router sends a prompt where it sent its prefix before
    (router/affinity.py), so every repeat finds its blocks cached, and a cache_salt keeps
    them to requests of the same salt."""
    cluster = cached_replicas
    prompt = "".join(random.choice("abcdefgh") for _ in range(41))
    body = {"model": TINY_MODEL_ID, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    assert len(cluster.verifiers) == 2

    def cached(**salt) -> int:
        r = post_json(f"{cluster.http}/v1/completions", {**body, **salt})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert [cached() for _ in range(4)] == [0, 40, 40, 40]  # 10 blocks of 4
    assert [cached(cache_salt="alice") for _ in range(3)] == [0, 40, 40]
    assert cached(cache_salt="bob") == 0


def test_a_reset_forgets_the_cached_prefixes_of_every_replica(cached_replicas):
    """vLLM's POST /reset_prefix_cache and SGLang's /flush_cache: both replicas and their
    drafter forget what they cached, so the next repeat of each prompt finds nothing and
    the one after finds it again; a request streaming across the reset ends as it would
    have."""
    cluster = cached_replicas
    prompts = ["".join(random.choice("abcdefgh") for _ in range(41)) for _ in range(4)]

    def cached(prompt: str) -> int:  # speculating: the drafter holds the prompt too
        body = {"model": TINY_MODEL_ID, "prompt": prompt, "max_tokens": 6, "temperature": 0}
        body["speculation"] = "on"
        r = post_json(f"{cluster.http}/v1/completions", body)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    def idle() -> list[int]:
        return [e.kv.allocator.num_idle for e in cluster.engines]

    def drafter_holds(cached: bool) -> bool:  # it hears of closes and resets after
        deadline = time.monotonic() + 10
        while (cluster.proposer.kv.allocator.num_idle > 0) != cached:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    assert [[cached(p), cached(p)] for p in prompts] == [[0, 40]] * 4
    assert all(idle()) and drafter_holds(True)  # each cache holds prefixes
    r = http("POST", f"{cluster.http}/reset_prefix_cache")
    assert (r.status_code, r.body, idle()) == (200, b"", [0, 0])
    assert drafter_holds(False)
    assert [cached(p) for p in prompts] == [0] * 4
    assert [cached(p) for p in prompts] == [40] * 4
    for method in ("GET", "POST"):
        r = http(method, f"{cluster.http}/flush_cache")
        assert (r.status_code, r.text, idle()) == (200, "Cache flushed.\n", [0, 0])
        assert cached(prompts[0]) == 0
    # a stream across a reset
    body = {"model": TINY_MODEL_ID, "prompt": prompts[1], "max_tokens": 40, "temperature": 0}
    whole = post_json(f"{cluster.http}/v1/completions", body).json()["choices"][0]["text"]
    raw = json.dumps({**body, "stream": True}).encode()
    req = urllib.request.Request(f"{cluster.http}/v1/completions", data=raw, method="POST")
    req.add_header("content-type", "application/json")
    texts = []
    with urllib.request.urlopen(req, timeout=30) as stream:
        for line in stream:
            if line.startswith(b"data: {"):
                texts.append(json.loads(line[6:])["choices"][0]["text"])
                if len(texts) == 1:
                    assert http("POST", f"{cluster.http}/reset_prefix_cache").status_code == 200
    assert len(texts) > 2 and "".join(texts) == whole


def test_bench_turns_reports_what_the_caches_held_turn_by_turn(cached_replicas, tmp_path):
    """`specd bench turns` on the tiny pair: later turns resend the conversation, which
    the replica that served it holds (all its whole blocks but the new ones)."""
    from bench.turns import run, summary, to_markdown

    chats = tmp_path / "chats.jsonl"
    lines = [
        {"messages": [{"role": "user", "content": f"{i} " + "x = 1; " * 12}]} for i in range(3)
    ]
    chats.write_text("\n".join(json.dumps(x) for x in lines))
    rows = run(cached_replicas.http, TINY_MODEL_ID, str(chats), 3, 2, 4)
    first, second = summary(rows)
    assert (first["requests"], second["requests"]) == (3, 3)
    assert first["cached_share"] < 0.1  # (the template's head)
    opened = {r["conversation"]: r["prompt_tokens"] for r in rows if r["turn"] == 1}
    for r in (r for r in rows if r["turn"] == 2):  # all of turn 1's whole blocks (of 4)
        assert r["cached_tokens"] >= opened[r["conversation"]] - 4, r
    assert "| 2 | 3 |" in to_markdown("tiny", [first, second])


def test_bench_predict_sends_the_prompts_code_as_the_prediction(cluster, tmp_path):
    """`specd bench predict` on the tiny pair: the `+prediction` mode sends the code block
    (its answers count predicted tokens), and its answers are `off`'s."""
    from bench.predict import bodies, run, to_markdown

    edits = tmp_path / "edits.jsonl"
    code = "def add(a, b):\n" + "    return a + b\n" * 6
    asks = [{"messages": [{"role": "user", "content": f"{i}\n```python\n{code}```"}]} for i in "ab"]
    edits.write_text("\n".join(json.dumps(x) for x in asks))
    asked = bodies(str(edits), 24)
    assert [c for _, c in asked] == [code, code]
    report = run(cluster.http, [], ["off", "on+prediction"], asked, 1, "", "")
    off, predicted = report["rows"]["specd off"], report["rows"]["specd on+prediction"]
    assert off["predicted"] is None and len(predicted["predicted"]) == 2
    assert predicted["same answers"] == 2
    assert "| specd on+prediction |" in to_markdown(report)
