"""Tools through the HTTP door (tiny models on loopback): the tools and earlier calls
rendered by the chat template; a named function or "required" constrains the output to
calls the tools' schemas allow; "auto" reads calls in the format the template teaches
(a door whose template teaches hermes); whole and streamed alike, speculation on and off;
bad tool fields refused naming them."""

import json

import grpc
import jsonschema
import openai
import pytest

from protos.specd.v1 import router_pb2
from tests.cluster import TINY_MODEL_ID, char_tokenizer
from tests.integration.openai_api.door import CHAT, CITY, post_json, side_door

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "now"}}
TOOLS = [WEATHER, TIME]
ALLOWED = {"get_weather": CITY, "get_time": {"type": "object", "maxProperties": 0}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
# a template that teaches hermes calls (the character vocabulary has no newline)
HERMES_TEMPLATE = (
    "{% if tools %}tools:{% for t in tools %} {{ t | tojson }}{% endfor %}; {% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
    "{% for c in m.tool_calls or [] %}<tool_call>"
    '{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}'
    "</tool_call>{% endfor %} {% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
CALL_TEXT = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


@pytest.fixture(scope="module")
def hermes(cluster):
    """A door over the same replicas whose router's template teaches hermes calls."""
    tokenizer = char_tokenizer()
    tokenizer.chat_template = HERMES_TEMPLATE
    with side_door(cluster, tokenizer) as client:
        yield client


def ask(client, stream=False, **fields):
    extra = {"speculation": "on", **fields.pop("extra_body", {})}
    return client.chat.completions.create(
        model=TINY_MODEL_ID,
        messages=fields.pop("messages", CHAT),
        max_tokens=fields.pop("max_tokens", 120),
        temperature=fields.pop("temperature", 0),
        stream=stream,
        extra_body=extra,
        **fields,
    )


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]


def streamed(client, **fields):
    """A streamed answer put together as the OpenAI SDK's users do: (content, calls by
    index as (id, name, arguments), finish reason)."""
    content, calls, finish = "", {}, None
    for chunk in ask(client, stream=True, **fields):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for c in choice.delta.tool_calls or []:
            got = calls.setdefault(c.index, ["", "", ""])
            got[0] += c.id or ""
            got[1] += c.function.name or ""
            got[2] += c.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def assert_same_as_stream(client, whole, **fields):
    content, calls, finish = streamed(client, **fields)
    message = whole.choices[0].message
    assert content == (message.content or "")
    assert [(name, args) for _, name, args in calls] == [
        (c.function.name, c.function.arguments) for c in message.tool_calls or []
    ]
    assert all(i.startswith("call_") for i, _, _ in calls)
    assert finish == whole.choices[0].finish_reason


def test_a_named_function_is_called_with_arguments_its_schema_allows(client):
    runs = {
        s: ask(client, tools=TOOLS, tool_choice=NAMED, extra_body={"speculation": s})
        for s in ("on", "off")
    }
    assert runs["on"].speculation["drafted"] > 0  # the door's extension
    for r in runs.values():
        message, finish = r.choices[0].message, r.choices[0].finish_reason
        assert finish == "stop" and message.content is None
        [(name, args)] = calls_of(message)
        assert name == "get_weather"
        jsonschema.validate(args, CITY)
    assert [c.function.arguments for c in runs["on"].choices[0].message.tool_calls] == [
        c.function.arguments for c in runs["off"].choices[0].message.tool_calls
    ]
    assert_same_as_stream(client, runs["on"], tools=TOOLS, tool_choice=NAMED)


def test_required_calls_one_or_more_of_the_tools(client):
    one = dict(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    r = ask(client, **one, n=3, temperature=1.0, seed=5)
    for choice in r.choices:
        calls = calls_of(choice.message)
        assert len(calls) == 1 and choice.finish_reason == "tool_calls", choice
        for name, args in calls:
            jsonschema.validate(args, ALLOWED[name])
    greedy = ask(client, tools=TOOLS, tool_choice="required", max_tokens=400)
    calls = calls_of(greedy.choices[0].message)
    assert len(calls) > 1 and greedy.choices[0].finish_reason == "tool_calls"  # in parallel
    for name, args in calls:
        jsonschema.validate(args, ALLOWED[name])
    assert_same_as_stream(client, greedy, tools=TOOLS, tool_choice="required", max_tokens=400)


def test_auto_reads_the_calls_the_template_teaches(hermes):
    """The model's own calls (forced here by a regex: the tiny model knows no tools), with
    text before them: the calls parsed, the text the content, finished with "tool_calls";
    streamed a token at a time the same, each call as it closes."""
    text = "Sure" + CALL_TEXT + " " + CALL_TEXT.replace("Paris", "Oslo")
    regex = {"guided_regex": text.replace("{", r"\{").replace("}", r"\}")}
    r = ask(hermes, tools=[WEATHER], extra_body=regex, max_tokens=170)
    message = r.choices[0].message
    calls = [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})]
    assert (message.content, calls_of(message)) == ("Sure", calls)
    assert r.choices[0].finish_reason == "tool_calls"
    assert_same_as_stream(hermes, r, tools=[WEATHER], extra_body=regex, max_tokens=170)


def test_auto_leaves_text_without_calls_as_it_is(hermes):
    none = ask(
        hermes, tools=TOOLS, tool_choice="none", max_tokens=40, extra_body={"ignore_eos": True}
    )
    auto = ask(hermes, tools=TOOLS, max_tokens=40, extra_body={"ignore_eos": True})
    assert "<tool_call>" not in none.choices[0].message.content
    assert auto.choices[0].message.content == none.choices[0].message.content
    assert auto.choices[0].message.tool_calls is None
    assert auto.choices[0].finish_reason == none.choices[0].finish_reason == "length"


def test_tools_and_earlier_calls_are_rendered_by_the_template(hermes):
    history = [
        *CHAT,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_7",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_7", "content": "sunny"},
    ]
    r = ask(
        hermes, tools=TOOLS, messages=history, max_tokens=2, extra_body={"return_token_ids": True}
    )
    prompt = char_tokenizer().decode(r.model_extra["prompt_token_ids"])
    assert prompt.startswith("tools: " + json.dumps(WEATHER)), prompt
    assert CALL_TEXT + " tool: sunny assistant: " in prompt
    door = str(hermes.base_url).removesuffix("/").removesuffix("/v1")
    said = post_json(f"{door}/tokenize", {"messages": history, "tools": TOOLS}).json()
    assert said["tokens"] == r.model_extra["prompt_token_ids"]  # /tokenize renders the same


@pytest.mark.parametrize(
    "fields, param, says",
    [
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": TOOLS}, "tool_choice", "auto"),  # the tiny template teaches no format
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
            "'x'",
        ),
        ({"tools": [{"type": "retrieval"}]}, "tools.0.type", "function"),
        (
            {"tools": [{"type": "function", "function": {"name": ""}}]},
            "tools.0.function.name",
            "at least 1",
        ),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "'auto' or 'required'"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            None,
            "at most one constraint",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}],
                    }
                ]
            },
            "messages.0.tool_calls.0.id",
            "required",
        ),
    ],
)
def test_bad_tool_fields_are_refused_naming_them(client, fields, param, says):
    with pytest.raises(openai.BadRequestError) as err:
        ask(client, **fields)
    assert err.value.body["param"] == param and says in err.value.message, err.value.body


def test_a_tool_schema_the_constraint_cannot_compile_is_refused(client):
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "objec"}}}
    with pytest.raises(openai.BadRequestError, match="objec"):
        ask(client, tools=[bad], tool_choice="required")


def test_grpc_tools_must_be_a_json_array(grpc_client):
    request = router_pb2.GenerateRequest(max_new_tokens=4)
    request.messages.messages.add(role="user", content="hi")
    request.messages.tools_json = '{"not": "an array"}'
    with pytest.raises(grpc.RpcError) as err:
        grpc_client.stub.Generate(request)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tools_json" in err.value.details()
