"""Structured output across the services: constraints travel router -> verifier -> drafter,
every output keeps to its constraint through both doors, greedy is the same with
speculation on and off, and bad constraints get INVALID_ARGUMENT / 400 with the
library's message (tiny models on loopback)."""

import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import openai
import pytest

from router.client import SpecdClient
from router.policy import Policy
from tests.cluster import TINY_MODEL_ID, char_tokenizer, start_cluster
from tests.conftest import wait_for
from tests.integration.openai_api.door import post_json
from tests.integration.test_services import wait_idle

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "size": {"enum": ["S", "M", "L"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "size", "ok"],
    "additionalProperties": False,
}
PROMPTS = ["Return the record: ", "def f(x):", "Q: name, size? A:", "{"]
POLICY = Policy.from_dict({"default": {"speculation": "on", "num_draft_tokens": 4}})


@pytest.fixture(scope="module")
def cluster(tiny_pair):
    c = start_cluster(*tiny_pair, policy=POLICY, alternatives=2)
    yield c
    c.close()


@pytest.fixture
def client(cluster):
    with SpecdClient(cluster.router) as c:
        yield c


def test_schema_outputs_validate_and_greedy_is_identical_on_and_off(cluster, client):
    finished = 0
    for prompt in PROMPTS:
        runs = {
            mode: client.generate(prompt, max_new_tokens=80, speculation=mode, json_schema=SCHEMA)
            for mode in ("off", "on")
        }
        assert list(runs["on"].token_ids) == list(runs["off"].token_ids), prompt
        assert runs["on"].speculation.drafted > 0 and runs["off"].speculation.drafted == 0
        for reply in runs.values():
            if reply.finish_reason == "stop":
                jsonschema.validate(json.loads(reply.text), SCHEMA)
                finished += 1
            else:
                assert reply.finish_reason == "length"
    assert finished > 0
    # the drafter drafted under the constraint: its sessions carried a grammar
    wait_idle(cluster)
    assert cluster.drafter_servicer.num_sessions == 0


def test_sampled_outputs_keep_to_regex_and_grammar(client):
    regex = "(red|green|blue)-[0-9]{2}"
    grammar = 'start: "[" num ("," num)* "]"\nnum: /[0-9]{1,2}/'
    for seed in range(6):
        reply = client.generate(
            PROMPTS[seed % 4], max_new_tokens=40, temperature=1.0, seed=seed, regex=regex
        )
        assert reply.finish_reason == "stop"
        assert reply.text.split("-")[0] in ("red", "green", "blue")
        assert len(reply.text.split("-")[1]) == 2
        reply = client.generate(
            PROMPTS[seed % 4], max_new_tokens=40, temperature=1.0, seed=seed, grammar=grammar
        )
        if reply.finish_reason == "stop":
            assert re.fullmatch(r"\[[0-9]{1,2}(,[0-9]{1,2})*\]", reply.text)
        else:
            assert reply.text.startswith("[")


def test_streaming_under_a_constraint_agrees_with_unary(client):
    unary = client.generate(PROMPTS[0], max_new_tokens=60, json_object=True)
    chunks = list(client.stream(PROMPTS[0], max_new_tokens=60, json_object=True))
    assert "".join(c.text for c in chunks) == unary.text
    if unary.finish_reason == "stop":
        assert isinstance(json.loads(unary.text), dict)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"regex": "[a-"}, "regex"),
        ({"json_schema": "{not json"}, "JSON"),
        ({"json_schema": {"type": "objec"}}, "objec"),
        ({"grammar": "start: nothing_here"}, "nothing_here"),
        ({"json_schema": "[" * 100_000 + "]" * 100_000}, "nested too deeply"),
    ],
)
def test_bad_constraints_are_invalid_argument(client, kwargs, message):
    with pytest.raises(grpc.RpcError) as err:
        client.generate(PROMPTS[0], max_new_tokens=8, **kwargs)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()


def test_a_constraint_with_no_output_is_refused_by_the_verifier(client):
    """Valid syntax, empty language: only the tokenizer-aware check can see it."""
    with pytest.raises(grpc.RpcError) as err:
        client.generate(PROMPTS[0], max_new_tokens=8, regex="[^\\s\\S]")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "admits no output" in err.value.details()


def test_openai_response_format_json_schema(cluster):
    sdk = openai.OpenAI(base_url=cluster.http + "/v1", api_key="none", max_retries=0)
    fmt = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA}}
    reply = sdk.chat.completions.create(
        model=TINY_MODEL_ID,
        messages=[{"role": "user", "content": "an item please"}],
        max_tokens=80,
        temperature=0,
        response_format=fmt,
    )
    choice = reply.choices[0]
    if choice.finish_reason == "stop":
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    else:
        assert choice.message.content.startswith("{")
    reply = sdk.completions.create(
        model=TINY_MODEL_ID,
        prompt="size:",
        max_tokens=10,
        extra_body={"guided_regex": "(S|M|L)!"},
    )
    assert reply.choices[0].text in ("S!", "M!", "L!")


def test_vllms_guided_choice_and_structured_outputs(cluster):
    """`guided_choice` and `structured_outputs` (vLLM's newer spelling): each answer one
    of the options, sampled; the regex and schema kinds too."""
    sdk = openai.OpenAI(base_url=cluster.http + "/v1", api_key="none", max_retries=0)
    options = ["yes", "no", "maybe so", '"quoted"']
    seen = set()
    for seed, extra in enumerate(
        [{"guided_choice": options}, {"structured_outputs": {"choice": options}}] * 4
    ):
        reply = sdk.completions.create(
            model=TINY_MODEL_ID, prompt="ok?", max_tokens=10, seed=seed, extra_body=extra
        )
        assert reply.choices[0].text in options and reply.choices[0].finish_reason == "stop"
        seen.add(reply.choices[0].text)
    assert len(seen) > 1  # sampled among them, not one forced
    regex = {"structured_outputs": {"regex": "(S|M|L)!"}}
    reply = sdk.completions.create(
        model=TINY_MODEL_ID, prompt="size:", max_tokens=10, extra_body=regex
    )
    assert reply.choices[0].text in ("S!", "M!", "L!")
    schema = {"structured_outputs": {"json": SCHEMA}}
    reply = sdk.completions.create(
        model=TINY_MODEL_ID, prompt="{", max_tokens=80, temperature=0, extra_body=schema
    )
    if reply.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(reply.choices[0].text), SCHEMA)
    url = cluster.http + "/v1/completions"
    body = {"model": TINY_MODEL_ID, "prompt": "x"}
    for bad, param in [
        ({"guided_choice": []}, "guided_choice"),
        ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, "structured_outputs"),
        ({"structured_outputs": {"choices": ["a"]}}, "structured_outputs.choices"),
        ({"guided_choice": ["a"], "guided_regex": "a"}, None),
    ]:
        reply = post_json(url, {**body, **bad})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text


def test_vllms_structural_tags_hold_where_the_trigger_comes(cluster):
    """`response_format: {type: structural_tag}`: the text is the model's own until the
    trigger, which then opens the structure (an integer, then "!"); greedy the same with
    speculation on and off. The trigger is the character the unconstrained output uses
    most, so the constrained one reaches it (its text before is the same)."""
    sdk = openai.OpenAI(base_url=cluster.http + "/v1", api_key="none", max_retries=0)
    ask = dict(model=TINY_MODEL_ID, prompt=PROMPTS[1], max_tokens=80, temperature=0)
    free = sdk.completions.create(**ask).choices[0].text
    trigger = max((c for c in set(free) if not c.isdigit() and c not in "!-"), key=free.count)
    tag = {"begin": trigger, "schema": {"type": "integer"}, "end": "!"}
    fmt = {"type": "structural_tag", "structures": [tag], "triggers": [trigger]}
    runs = {
        mode: sdk.completions.create(
            **ask, extra_body={"response_format": fmt, "speculation": mode}
        ).choices[0]
        for mode in ("off", "on")
    }
    assert runs["on"].text == runs["off"].text
    text, finish = runs["on"].text, runs["on"].finish_reason
    assert text.startswith(free[: free.index(trigger) + 1])
    *opened, last = text.split(trigger)[1:] or [None]
    for part in opened:
        assert re.match(r"\s*-?[0-9]+\s*!", part), text
    if last is not None and not re.match(r"\s*-?[0-9]+\s*!", last):
        assert finish == "length" and re.fullmatch(r"\s*-?[0-9]*\s*", last), text
    # vLLM's newer spelling: the same tags as JSON text in structured_outputs
    spelled = {"structural_tag": json.dumps({"structures": [tag], "triggers": [trigger]})}
    again = sdk.completions.create(**ask, extra_body={"structured_outputs": spelled})
    assert again.choices[0].text == text
    bad = {**fmt, "structures": [{**tag, "begin": "#" + trigger}], "triggers": [trigger]}
    param = "structured_outputs.structural_tag"
    for field, refused in [
        ("response_format", bad),
        ("structured_outputs", {"structural_tag": json.dumps({"structures": [{"begin": "a"}]})}),
        ("structured_outputs", {"structural_tag": "{not json"}),
    ]:
        reply = post_json(cluster.http + "/v1/completions", {**ask, field: refused})
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["param"] == (
            "response_format" if field == "response_format" else param
        )


def test_openai_bad_response_format_is_400(cluster):
    url = cluster.http + "/v1/chat/completions"
    body = {"model": TINY_MODEL_ID, "messages": [{"role": "user", "content": "x"}]}
    bad = post_json(url, {**body, "response_format": {"type": "json_schema"}})
    assert bad.status_code == 400 and "json_schema" in bad.json()["error"]["message"]
    two = post_json(url, {**body, "guided_regex": "a", "response_format": {"type": "json_object"}})
    assert two.status_code == 400 and "one constraint" in two.json()["error"]["message"]
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}
    invalid = post_json(url, {**body, "response_format": schema})
    assert invalid.status_code == 400 and "objec" in invalid.json()["error"]["message"]


def test_llama_servers_constraint_fields_on_every_endpoint(cluster):
    """llama-server's `grammar` (GBNF) and `json_schema`, on its /completion and on the
    OpenAI endpoints, and its `response_format: {"type": "json_object", "schema": ...}`:
    each answer keeps to it; two at once, or GBNF llguidance cannot read, is a 400."""
    sizes = ['"S"', '"M"', '"L"']
    gbnf = {"grammar": 'root ::= size "!"\nsize ::= "S" | "M" | "L"'}
    enum = {"json_schema": {"enum": ["S", "M", "L"]}}
    chat = {"model": TINY_MODEL_ID, "messages": [{"role": "user", "content": "size?"}]}
    for path, body, key in [
        ("/completion", {"prompt": "size:", "n_predict": 8}, "content"),
        ("/v1/completions", {"model": TINY_MODEL_ID, "prompt": "size:", "max_tokens": 8}, "text"),
        ("/v1/chat/completions", {**chat, "max_tokens": 8}, "message"),
    ]:
        for fields, answers in [(gbnf, ["S!", "M!", "L!"]), (enum, sizes)]:
            reply = post_json(cluster.http + path, {**body, **fields, "seed": 1}).json()
            answer = reply[key] if path == "/completion" else reply["choices"][0][key]
            assert (answer["content"] if key == "message" else answer) in answers, reply
        both = post_json(cluster.http + path, {**body, **gbnf, **enum})
        bad = post_json(cluster.http + path, {**body, "grammar": "root ::= ("})
        assert both.status_code == 400 and "one constraint" in both.text, both.text
        assert bad.status_code == 400 and "GBNF" in bad.text, bad.text
    fmt = {"type": "json_object", "schema": enum["json_schema"]}
    reply = post_json(cluster.http + "/v1/chat/completions", {**chat, "response_format": fmt})
    assert reply.json()["choices"][0]["message"]["content"] in sizes, reply.text


def test_a_first_constraint_loads_the_tokenizer_while_other_streams_run(tiny_pair):
    """The tokenizer is loaded at a verifier's first constrained request, in a worker
    thread: streams on the same event loop go on meanwhile."""
    called, release = threading.Event(), threading.Event()

    def slow_tokenizer():
        called.set()
        assert release.wait(60)
        return char_tokenizer()

    c = start_cluster(*tiny_pair, policy=POLICY, load_tokenizer=slow_tokenizer)
    try:
        with SpecdClient(c.router) as client, ThreadPoolExecutor(1) as pool:
            first = pool.submit(client.generate, "{", max_new_tokens=8, json_schema=SCHEMA)
            wait_for(called.is_set)
            plain = client.generate("def f(x):", max_new_tokens=16, ignore_eos=True, timeout=20)
            assert len(plain.token_ids) == 16 and not first.done()
            release.set()
            assert len(first.result(timeout=60).token_ids) == 8
    finally:
        release.set()
        c.close()
