"""Anthropic's Messages API body as the chat it stands for (router/anthropic_schema.py),
and its answer's stream of events (router/anthropic_answer.py)."""

import json

import pytest

from protos.specd.v1 import router_pb2
from router.anthropic_answer import AnthropicAnswer
from router.anthropic_schema import MessagesBody
from router.body import BodyError, parse
from router.tools import HERMES, ToolUse


def chat_of(**fields):
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    return parse(json.dumps(body | fields).encode(), MessagesBody).chat_body()


def test_blocks_are_the_chats_messages_tool_results_before_the_users_text():
    conversation = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "looking"},
                {"type": "tool_use", "id": "t1", "name": "f", "input": {"x": "é"}},
                {"type": "tool_use", "id": "t2", "name": "g", "input": {}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "so?"},
                {"type": "tool_result", "tool_use_id": "t1", "content": "one"},
                {
                    "type": "tool_result",
                    "tool_use_id": "t2",
                    "content": [{"type": "text", "text": "two"}],
                },
            ],
        },
    ]
    chat = chat_of(system=[{"type": "text", "text": "Be brief."}], messages=conversation)
    call = lambda i, name, args: {  # noqa: E731
        "id": i, "type": "function", "function": {"name": name, "arguments": args}
    }  # fmt: skip
    assert [m.model_dump(exclude_none=True) for m in chat.messages] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "ab"},
        {
            "role": "assistant",
            "content": "looking",
            "tool_calls": [call("t1", "f", '{"x": "é"}'), call("t2", "g", "{}")],
        },
        {"role": "tool", "content": "one", "tool_call_id": "t1"},
        {"role": "tool", "content": "two", "tool_call_id": "t2"},
        {"role": "user", "content": "so?"},
    ]
    with pytest.raises(BodyError) as err:
        chat_of(messages=[{"role": "user", "content": [conversation[1]["content"][1]]}])
    assert err.value.param == "messages.0.content"


def test_tools_choice_limits_and_format_take_the_chats_spelling():
    tool = {"name": "f", "description": "d", "input_schema": {"type": "object"}}
    chat = chat_of(
        tools=[tool],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        stop_sequences=["END"],
        temperature=0.5,
        output_config={"format": {"type": "json_schema", "schema": {"type": "object"}}},
    )
    assert chat.tools[0].function.parameters == {"type": "object"}
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert chat.stop == ["END"] and chat.temperature == 0.5 and chat.max_new_tokens() == 5
    assert chat.response_format.json_schema.schema_ == {"type": "object"}
    named = chat_of(tools=[tool], tool_choice={"type": "tool", "name": "f"})
    assert named.tool_choice.function.name == "f"
    assert chat_of(tools=[tool], tool_choice={"type": "none"}).tool_choice == "none"


def test_a_streamed_text_then_call_closes_the_text_block_before_the_calls():
    tools = ToolUse([{"type": "function", "function": {"name": "f"}}], "auto", format=HERMES)
    answer = AnthropicAnswer("m", tools)
    call = '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    usage = {"prompt_tokens": 3, "completion_tokens": 9}
    msgs = [
        router_pb2.GenerateStreamResponse(text="Looking. ", usage=usage),
        router_pb2.GenerateStreamResponse(text=call),
        router_pb2.GenerateStreamResponse(finish_reason="stop", usage=usage),
    ]
    events = [e for m in msgs for e in answer.chunks(0, m)]
    shape = [(e["type"], e.get("index")) for e in events]
    assert shape == [
        ("message_start", None),
        ("content_block_start", 0),
        ("content_block_delta", 0),
        ("content_block_stop", 0),
        ("content_block_start", 1),
        ("content_block_delta", 1),
        ("content_block_stop", 1),
        ("message_delta", None),
        ("message_stop", None),
    ]
    assert events[4]["content_block"]["name"] == "f"
    assert json.loads(events[5]["delta"]["partial_json"]) == {"a": 1}
    assert events[7]["delta"]["stop_reason"] == "tool_use"
    assert events[7]["usage"]["output_tokens"] == 9
