"""The Responses API's body as the chat it stands for (router/responses_schema.py):
instructions, input items, tools, tool choice and text format in the chat's shape."""

import json

import pytest

from router.body import BodyError, parse
from router.responses_schema import ResponsesBody


def chat_of(**fields):
    body = parse(json.dumps({"model": "m", "input": "hi"} | fields).encode(), ResponsesBody)
    return body.chat_body()


def test_instructions_and_input_items_are_the_chats_messages():
    """A text and calls the model made in one turn are one assistant message; each
    call's output a tool message."""
    items = [
        {
            "role": "user",
            "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}],
        },
        {
            "type": "message",
            "role": "assistant",
            "id": "msg_1",
            "status": "completed",
            "content": [{"type": "output_text", "text": "let me look", "annotations": []}],
        },
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        # an output item as the SDK dumps it, its unset fields null
        {
            **{"type": "function_call", "call_id": "c2", "name": "g", "arguments": '{"x": 1}'},
            **{"id": "fc_1", "status": "completed", "caller": None, "namespace": None},
            "async": None,
        },
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": "two"},
        {"type": "function_call", "call_id": "c3", "name": "f", "arguments": "{}"},
    ]
    chat = chat_of(instructions="Be brief.", input=items)
    got = [m.model_dump(exclude_none=True) for m in chat.messages]
    call = lambda i, name, args: {  # noqa: E731
        "id": i, "type": "function", "function": {"name": name, "arguments": args}
    }  # fmt: skip
    assert got == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "ab"},
        {
            "role": "assistant",
            "content": "let me look",
            "tool_calls": [call("c1", "f", "{}"), call("c2", "g", '{"x": 1}')],
        },
        {"role": "tool", "content": "one", "tool_call_id": "c1"},
        {"role": "tool", "content": "two", "tool_call_id": "c2"},
        {"role": "assistant", "content": "", "tool_calls": [call("c3", "f", "{}")]},
    ]


def test_tools_choice_format_and_limits_take_the_chats_spelling():
    tool = {"type": "function", "name": "f", "description": "d", "parameters": {"type": "object"}}
    fmt = {"type": "json_schema", "name": "n", "schema": {"type": "object"}, "strict": True}
    chat = chat_of(
        tools=[tool],
        tool_choice={"type": "function", "name": "f"},
        text={"format": fmt},
        max_output_tokens=7,
        temperature=0.5,
    )
    assert chat.tools[0].function.model_dump(exclude_none=True) == {
        "name": "f", "description": "d", "parameters": {"type": "object"}
    }  # fmt: skip
    assert chat.tool_choice.function.name == "f"
    assert chat.response_format.json_schema.schema_ == {"type": "object"}
    assert chat.max_new_tokens() == 7 and chat.temperature == 0.5
    assert chat_of(text={"format": {"type": "json_object"}}).response_format.type == "json_object"
    assert chat_of().response_format is None and chat_of().tools is None
    with pytest.raises(BodyError) as err:
        chat_of(text={"format": {"type": "json_schema"}})
    assert err.value.param == "text.format"


def test_a_streamed_text_then_call_closes_the_message_before_the_call_item():
    """Text, then a hermes call in the next message, then the finish: the message item
    is done (index 0) before the call's item is added (index 1); the final response holds
    both."""
    from protos.specd.v1 import router_pb2
    from router.responses_answer import ResponsesAnswer
    from router.tools import HERMES, ToolUse

    body = parse(b'{"model": "m", "input": "hi"}', ResponsesBody)
    tools = ToolUse([{"type": "function", "function": {"name": "f"}}], "auto", format=HERMES)
    answer = ResponsesAnswer("resp_1", "m", body, tools)
    call = '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    msgs = [
        router_pb2.GenerateStreamResponse(text="Looking. "),
        router_pb2.GenerateStreamResponse(text=call),
        router_pb2.GenerateStreamResponse(finish_reason="stop"),
    ]
    events = [e for i, m in enumerate(msgs) for e in answer.chunks(0, m)]
    placed = [
        (e["type"], e["output_index"], e["item"]["type"])
        for e in events
        if e["type"].startswith("response.output_item")
    ]
    assert placed == [
        ("response.output_item.added", 0, "message"),
        ("response.output_item.done", 0, "message"),
        ("response.output_item.added", 1, "function_call"),
        ("response.output_item.done", 1, "function_call"),
    ]
    final = events[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["message", "function_call"]
    assert final["output"][0]["content"][0]["text"] == "Looking. "
    assert json.loads(final["output"][1]["arguments"]) == {"a": 1}
