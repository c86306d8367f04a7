"""A reasoning model's thinking read apart (router/reasoning.py), whole and streamed in
any chunking alike, and as each door answers it: chat's reasoning_content, the Responses
API's reasoning item, Anthropic's thinking block."""

import json
import random

import pytest

from protos.specd.v1 import router_pb2
from router.anthropic_answer import AnthropicAnswer
from router.body import parse
from router.openai_answer import Answer
from router.openai_schema import ChatBody
from router.reasoning import ThinkReader, check_parser
from router.responses_answer import ResponsesAnswer
from router.responses_schema import ResponsesBody

CASES = [
    ("qwen3", "<think>\nhmm\n</think>\n\nAnswer.", "\nhmm\n", "Answer."),
    ("qwen3", "Answer only.", "", "Answer only."),  # enable_thinking: false
    ("qwen3", "  <think>a</think>b", "a", "b"),
    ("qwen3", "<thin", "", "<thin"),  # ended before its tag did: answer
    ("qwen3", "<think>cut off", "cut off", ""),
    ("deepseek_r1", "plan</think>\n\nDone", "plan", "Done"),  # the tag was in the prompt
    ("deepseek_r1", "<think>plan</think>Done", "plan", "Done"),
    ("deepseek_r1", "only thinking", "only thinking", ""),
    ("deepseek_r1", "a </thi", "a </thi", ""),
]


@pytest.mark.parametrize("parser,text,thinking,answer", CASES)
def test_thinking_and_answer_are_the_same_whole_and_in_any_chunking(parser, text, thinking, answer):
    assert ThinkReader(parser).read(text, final=True) == (thinking, answer)
    rng = random.Random(0)
    for _ in range(30):
        reader, got, start = ThinkReader(parser), ["", ""], 0
        while start < len(text):
            end = start + rng.randint(1, 4)
            parts = reader.read(text[start:end], final=end >= len(text))
            got = [got[0] + parts[0], got[1] + parts[1]]
            start = end
        assert tuple(got) == (thinking, answer)


def test_a_parser_the_router_does_not_know_is_refused():
    assert check_parser("") is None and check_parser("qwen3") == "qwen3"
    with pytest.raises(ValueError, match="deepseek_r1"):
        check_parser("granite")


TEXT = "<think>I should greet.</think>\n\nHello!"


def messages(*parts: str) -> list:
    """The router's stream messages for these text parts, the last finishing."""
    usage = {"prompt_tokens": 5, "completion_tokens": 9}
    out = [router_pb2.GenerateStreamResponse(text=p, usage=usage) for p in parts]
    out[-1].finish_reason = "stop"
    return out


def test_chat_answers_the_thinking_as_reasoning_content_whole_and_streamed():
    body = ChatBody.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    whole = Answer("chat.completion", "c", "m", body, [[1]], reasoning="qwen3").whole(
        messages(TEXT)
    )
    message = whole["choices"][0]["message"]
    assert message["reasoning_content"] == "I should greet." and message["content"] == "Hello!"
    answer = Answer("chat.completion", "c", "m", body, [[1]], reasoning="qwen3")
    deltas = [
        c["choices"][0]["delta"]
        for m in messages("<th", "ink>I should", " greet.</think>\n", "\nHello!")
        for c in answer.chunks(0, m)
    ]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "I should greet."
    assert "".join(d.get("content") or "" for d in deltas) == "Hello!"
    plain = Answer("chat.completion", "c", "m", body, [[1]]).whole(messages(TEXT))
    assert plain["choices"][0]["message"]["content"] == TEXT  # no parser: as vLLM
    assert "reasoning_content" not in plain["choices"][0]["message"]


def test_the_responses_api_answers_it_as_a_reasoning_item_before_the_message():
    body = parse(b'{"model": "m", "input": "hi"}', ResponsesBody)
    whole = ResponsesAnswer("r", "m", body, None, "qwen3").whole(messages(TEXT))
    assert [i["type"] for i in whole["output"]] == ["reasoning", "message"]
    assert whole["output"][0]["content"][0]["text"] == "I should greet."
    assert whole["output"][1]["content"][0]["text"] == "Hello!"
    answer = ResponsesAnswer("r", "m", body, None, "qwen3")
    events = [
        e
        for m in messages("<think>I should", " greet.</think>", "Hello!")
        for e in answer.chunks(0, m)
    ]
    kinds = [e["type"] for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    thought = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert thought == "I should greet."
    final = events[-1]["response"]["output"]
    assert [(i["type"], i["status"]) for i in final] == [
        ("reasoning", "completed"),
        ("message", "completed"),
    ]
    again = {"model": "m", "input": [{"role": "user", "content": "hi"}, *final]}  # handed back
    chat = parse(json.dumps(again).encode(), ResponsesBody).chat_body()
    assert [m.role for m in chat.messages] == ["user", "assistant"]
    assert chat.messages[1].content == "Hello!"


def test_anthropic_answers_it_as_a_thinking_block_first():
    from router.anthropic_schema import MessagesBody

    body = {"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": "hi"}]}
    whole = AnthropicAnswer("m", None, "qwen3").whole(messages(TEXT))
    assert [b["type"] for b in whole["content"]] == ["thinking", "text"]
    assert whole["content"][0]["thinking"] == "I should greet."
    answer = AnthropicAnswer("m", None, "qwen3")
    events = [
        e
        for m in messages("<think>I should", " greet.</think>", "Hello!")
        for e in answer.chunks(0, m)
    ]
    shape = [(e["type"], e.get("index")) for e in events if e["type"].startswith("content_block")]
    assert shape == [
        ("content_block_start", 0),
        ("content_block_delta", 0),
        ("content_block_delta", 0),
        ("content_block_stop", 0),
        ("content_block_start", 1),
        ("content_block_delta", 1),
        ("content_block_stop", 1),
    ]
    assert events[2]["delta"] == {"type": "thinking_delta", "thinking": "I should"}
    back = body | {
        "messages": [*body["messages"], {"role": "assistant", "content": whole["content"]}]
    }
    chat = parse(json.dumps(back).encode(), MessagesBody).chat_body()
    assert chat.messages[-1].content == "Hello!"  # the thinking left out
