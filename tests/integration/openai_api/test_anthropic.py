"""Anthropic's Messages API (`POST /v1/messages`) through the `anthropic` SDK, on the tiny
models: a message is the chat it stands for (the same text and token counts, whole and
streamed as Anthropic's events, speculation on and off), stop sequences and the token
limit give Anthropic's stop reasons, tool calls come back as `tool_use` blocks, earlier
calls and results are the conversation, and errors come in Anthropic's shape and words."""

import re

import anthropic
import jsonschema
import pytest

from tests.cluster import TINY_MODEL_ID
from tests.integration.openai_api.door import (
    CITY,
    TOKEN,
    called,
    http,
    post_json,
    terse_chat,
    url,
)

WEATHER = {"name": "get_weather", "description": "the weather", "input_schema": CITY}


@pytest.fixture
def claude(cluster):
    with anthropic.Anthropic(base_url=cluster.http, api_key="unused", max_retries=0) as c:
        yield c


def greedy(speculation: str, fields: dict) -> dict:
    """A greedy request's arguments (the SDK no longer takes `temperature`; the API does)."""
    base = {"model": TINY_MODEL_ID, "max_tokens": 12}
    base["messages"] = [{"role": "user", "content": "ab"}]
    return base | fields | {"extra_body": {"speculation": speculation, "temperature": 0}}


def ask(claude, speculation="on", **fields):
    return claude.messages.create(**greedy(speculation, fields))


def stream(claude, speculation="on", **fields):
    with claude.messages.stream(**greedy(speculation, fields)) as s:
        events = list(s)
        return events, s.get_final_message()


@pytest.mark.parametrize("speculation", ["off", "on"])
def test_a_message_is_the_chat_it_stands_for_whole_and_streamed(client, claude, speculation):
    chat = terse_chat(client, speculation)
    want = chat.choices[0]
    whole = ask(claude, speculation, system="Be terse.")
    assert whole.id.startswith("msg_") and whole.role == "assistant"
    assert [b.type for b in whole.content] == ["text"]
    assert whole.content[0].text == want.message.content
    assert whole.stop_reason == ("max_tokens" if want.finish_reason == "length" else "end_turn")
    assert whole.usage.input_tokens == chat.usage.prompt_tokens
    assert whole.usage.output_tokens == chat.usage.completion_tokens
    assert (whole.model_extra["speculation"]["drafted"] > 0) == (speculation == "on")
    events, final = stream(claude, speculation, system=[{"type": "text", "text": "Be terse."}])
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert events[0].message.usage.input_tokens == whole.usage.input_tokens
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_stop_sequences_and_the_token_limit_are_anthropics_stop_reasons(claude):
    plain = ask(claude).content[0].text
    stop = plain[3:5]
    cut = ask(claude, stop_sequences=[stop])
    assert cut.content[0].text == plain[: plain.index(stop)]
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    _, streamed = stream(claude, stop_sequences=[stop])
    assert streamed.stop_reason == "stop_sequence" and streamed.stop_sequence == stop
    short = ask(claude, max_tokens=2)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 2


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_tool_calls_come_back_as_tool_use_blocks(claude, choice):
    """`any` or a named tool constrains the output to calls: each a tool_use block whose
    input the tool's schema allows, stop reason tool_use; streamed, its input as one
    input_json_delta."""
    fields = {"tools": [WEATHER], "max_tokens": 120}
    fields["tool_choice"] = {**choice, "disable_parallel_tool_use": True}
    whole = ask(claude, **fields)
    assert [b.type for b in whole.content] == ["tool_use"] and whole.stop_reason == "tool_use"
    jsonschema.validate(whole.content[0].input, CITY)
    # the blocks handed back as the SDK dumps them, with the call's result: served
    result = {"type": "tool_result", "tool_use_id": whole.content[0].id, "content": "ok"}
    again = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [b.model_dump() for b in whole.content]},
        {"role": "user", "content": [result]},
    ]
    assert ask(claude, messages=again, max_tokens=2).stop_reason == "max_tokens"
    events, final = stream(claude, **fields)
    assert "input_json" in [e.type for e in events]  # the SDK's own event for the delta
    assert [(b.name, b.input) for b in final.content] == [("get_weather", whole.content[0].input)]
    assert final.stop_reason == "tool_use"


def test_earlier_calls_and_results_are_the_conversation_and_are_counted(cluster, claude):
    conversation = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": "c1", "name": "get_weather", "input": {"city": "Oslo"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "c1", "content": "sunny"},
                {"type": "text", "text": "and so?"},
            ],
        },
    ]
    chat = called("weather?", '{"city": "Oslo"}', "sunny", then="and so?")
    count = post_json(f"{cluster.http}/tokenize", {"messages": chat}).json()["count"]
    counted = claude.messages.count_tokens(model=TINY_MODEL_ID, messages=conversation)
    assert counted.input_tokens == count
    assert ask(claude, messages=conversation, max_tokens=2).usage.input_tokens == count


@pytest.mark.parametrize(
    ("fields", "status", "said"),
    [
        ({"max_tokens": None}, 400, "max_tokens"),
        ({"model": "claude-x"}, 404, "claude-x"),
        ({"messages": [{"role": "user", "content": [{"type": "image"}]}]}, 400, "'image'"),
        ({"tool_choice": {"type": "tool"}}, 400, "name"),
        ({"temperature": -1}, 400, "temperature"),
        ({"frobnicate": 1}, 400, "frobnicate"),
    ],
)
def test_errors_come_in_anthropics_shape(cluster, fields, status, said):
    body = {"model": TINY_MODEL_ID, "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
    body = {k: v for k, v in (body | fields).items() if v is not None}
    if "tool_choice" in fields:
        body["tools"] = [WEATHER]
    r = post_json(f"{cluster.http}/v1/messages", body)
    assert r.status_code == status, r.text
    error = r.json()
    assert error["type"] == "error" and said in error["error"]["message"], error
    assert error["error"]["type"] in ("invalid_request_error", "not_found_error")


def test_the_key_may_come_as_x_api_key(cluster):
    body = {"model": TINY_MODEL_ID, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}
    secured = f"{url(cluster, 0)}/v1/messages"
    assert post_json(secured, body, {"x-api-key": TOKEN}).status_code == 200
    refused = post_json(secured, body, {"x-api-key": "wrong"})
    assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
    with anthropic.Anthropic(base_url=url(cluster, 0), api_key=TOKEN, max_retries=0) as c:
        reply = c.messages.create(model=TINY_MODEL_ID, max_tokens=2, messages=body["messages"])
    assert reply.usage.output_tokens == 2


def test_what_claude_code_sends_for_anthropics_betas_is_taken_and_changes_nothing(cluster):
    """Claude Code sends `context_management` on every request (a gateway that refuses it
    refuses Claude Code), tools with `input_examples` or `defer_loading`, `thinking` with
    `display`, `output_config.task_budget`: the answer is the one without them."""
    tool = WEATHER | {"input_examples": [{"city": "Paris"}], "defer_loading": True}
    base = {"model": TINY_MODEL_ID, "max_tokens": 12, "temperature": 0, "tools": [WEATHER]}
    base |= {"tool_choice": {"type": "none"}, "messages": [{"role": "user", "content": "ab"}]}
    betas = base | {
        "tools": [tool],
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "thinking": {"type": "disabled", "display": "omitted"},
        "output_config": {"effort": "high", "task_budget": {"type": "tokens", "total": 4000}},
        "metadata": {"user_id": "u"},
    }
    header = {"anthropic-beta": "context-management-2025-06-27,claude-code-20250219"}
    plain = post_json(f"{cluster.http}/v1/messages", base)
    taken = post_json(f"{cluster.http}/v1/messages", betas, header)
    assert plain.status_code == taken.status_code == 200, taken.text
    assert taken.json()["content"] == plain.json()["content"]
    fields = ("model", "messages", "tools", "tool_choice", "thinking", "context_management")
    counting = {k: betas[k] for k in fields}
    counted = post_json(f"{cluster.http}/v1/messages/count_tokens", counting, header)
    assert counted.status_code == 200, counted.text
    refused = post_json(f"{cluster.http}/v1/messages", base | {"context_management": {"x": 1}})
    assert refused.status_code == 400 and "context_management.x" in refused.text


def test_past_the_context_is_said_in_anthropics_words(cluster, claude):
    """Claude Code and LiteLLM read "prompt is too long" as the context window's end (and
    compact the conversation); Anthropic says the prompt-and-max_tokens case its own way."""
    models = http("GET", f"{cluster.http}/v1/models").json()["data"]
    context = models[0]["max_model_len"]
    with pytest.raises(anthropic.BadRequestError) as err:
        ask(claude, messages=[{"role": "user", "content": "x" * context}], max_tokens=4)
    found = re.fullmatch(r"prompt is too long: (\d+) tokens > (\d+) maximum", message(err))
    assert found and int(found[1]) > int(found[2]) == context, message(err)
    with pytest.raises(anthropic.BadRequestError) as err:
        ask(claude, max_tokens=context)
    found = re.fullmatch(
        r"input length and `max_tokens` exceed context limit: (\d+) \+ (\d+) > (\d+), "
        r"decrease input length or `max_tokens` and try again",
        message(err),
    )
    assert found and int(found[1]) > 0 and int(found[2]) == int(found[3]) == context, message(err)


def message(err) -> str:
    body = err.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    return body["error"]["message"]
