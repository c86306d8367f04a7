"""OpenAI's Responses API (`POST /v1/responses`) through the `openai` SDK, on the tiny
models: a response is the chat it stands for (the same text and token counts, whole and
streamed as the API's semantic events, speculation on and off), function calls come back
as `function_call` items, `text.format` constrains the text, and what a stateless server
cannot do is refused naming the field."""

import json

import jsonschema
import openai
import pytest

from tests.cluster import TINY_MODEL_ID
from tests.integration.openai_api.door import CITY, called, post_json, terse_chat

WEATHER = {"type": "function", "name": "get_weather", "parameters": CITY}


def respond(client, speculation="on", **fields):
    ask = {"model": TINY_MODEL_ID, "temperature": 0, "max_output_tokens": 12}
    extra = {"speculation": speculation}
    return client.responses.create(**(ask | fields), extra_body=extra)


@pytest.mark.parametrize("speculation", ["off", "on"])
def test_a_response_is_the_chat_it_stands_for_whole_and_streamed(client, speculation):
    chat = terse_chat(client, speculation)
    want = chat.choices[0]
    whole = respond(client, speculation, instructions="Be terse.", input="ab")
    assert whole.id.startswith("resp_") and whole.object == "response"
    assert whole.output_text == want.message.content
    assert whole.status == ("incomplete" if want.finish_reason == "length" else "completed")
    assert whole.usage.input_tokens == chat.usage.prompt_tokens
    assert whole.usage.output_tokens == chat.usage.completion_tokens
    assert [item.type for item in whole.output] == ["message"]
    assert (whole.model_extra["speculation"]["drafted"] > 0) == (speculation == "on")
    events = list(respond(client, speculation, instructions="Be terse.", input="ab", stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert kinds[-1] == f"response.{whole.status}"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-4].text
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == whole.usage.output_tokens


def test_the_token_limit_leaves_a_response_incomplete(client):
    short = respond(client, input="ab", max_output_tokens=2)
    assert short.status == "incomplete" and short.usage.output_tokens == 2
    assert short.incomplete_details.reason == "max_output_tokens"
    assert short.output[0].status == "incomplete"
    # a limit on built-in tools' calls (Codex sends one): specd runs none, answered back
    limited = respond(client, input="ab", max_output_tokens=2, max_tool_calls=3)
    assert limited.max_tool_calls == 3 and limited.output_text == short.output_text


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "choice", [{"type": "function", "name": "get_weather"}, "required"], ids=["named", "required"]
)
def test_function_calls_come_back_as_items(client, stream, choice):
    """A named function or `required` constrains the output to calls: each comes back
    as a function_call item whose arguments the tool's schema allows; streamed, as the
    API's item and arguments events, ending in the same response."""
    fields = {"input": "weather?", "tools": [WEATHER], "tool_choice": choice}
    fields |= {"max_output_tokens": 120, "parallel_tool_calls": False}
    if not stream:
        calls = respond(client, **fields).output
        # the items handed back as the SDK dumps them, with the calls' outputs: served
        answered = [
            {"type": "function_call_output", "call_id": c.call_id, "output": "ok"} for c in calls
        ]
        again = [
            {"role": "user", "content": "weather?"},
            *[c.model_dump() for c in calls],
            *answered,
        ]
        assert respond(client, input=again, max_output_tokens=2).status == "incomplete"
    else:
        events = list(respond(client, stream=True, **fields))
        kinds = [e.type for e in events]
        assert "response.function_call_arguments.done" in kinds
        assert "response.output_text.delta" not in kinds  # calls only, no message
        calls = events[-1].response.output
        done = [e.item for e in events if e.type == "response.output_item.done"]
        assert [c.arguments for c in done] == [c.arguments for c in calls]
    assert calls and all(c.type == "function_call" and c.name == "get_weather" for c in calls)
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), CITY)
        assert call.call_id.startswith("call_") and call.status == "completed"


def test_a_text_format_constrains_the_text(client):
    fmt = {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}
    r = respond(client, input="city?", text={"format": fmt}, max_output_tokens=200)
    assert r.status == "completed"  # the tiny model writes much whitespace first
    jsonschema.validate(json.loads(r.output_text), CITY)
    assert r.text.format.type == "json_schema" and r.text.format.name == "city"


def test_earlier_calls_and_their_outputs_are_the_conversation(cluster, client):
    """Input items (messages, a call and its output) render as the chat with the same
    messages: the same prompt length."""
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    ]
    chat = called("weather?", "{}", "sunny")
    count = post_json(f"{cluster.http}/tokenize", {"messages": chat}).json()["count"]
    assert respond(client, input=items, max_output_tokens=2).usage.input_tokens == count


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"background": True}, "background"),
        ({"truncation": "auto"}, "truncation"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"input": []}, "input"),
        ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input.0.type"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"frobnicate": 1}, "frobnicate"),
    ],
)
def test_what_a_stateless_server_cannot_do_is_refused_naming_the_field(cluster, fields, param):
    body = {"model": TINY_MODEL_ID, "input": "ab"} | fields
    r = post_json(f"{cluster.http}/v1/responses", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_the_sdk_reads_a_refusal_as_its_error(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=TINY_MODEL_ID, input="ab", previous_response_id="resp_x")
    assert "previous_response_id" in err.value.message


def test_each_event_is_named_by_its_type_and_no_done_marker_follows(cluster):
    body = {"model": TINY_MODEL_ID, "input": "ab", "max_output_tokens": 3, "stream": True}
    r = post_json(f"{cluster.http}/v1/responses", body)
    events = r.text.strip().split("\n\n")
    for event in events:
        name, data = event.split("\n")
        assert name == "event: " + json.loads(data.removeprefix("data: "))["type"]
    assert events[0].startswith("event: response.created") and "[DONE]" not in r.text


def test_a_stored_response_asked_for_is_a_clear_404(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.retrieve("resp_123")
    assert "keeps no responses" in err.value.message
    with pytest.raises(openai.NotFoundError):
        client.responses.delete("resp_123")


@pytest.mark.parametrize("door", ["responses", "messages"])
def test_a_client_leaving_either_new_door_mid_stream_frees_its_request(cluster, aborts, door):
    """The Responses and Messages doors stream through the chat's path: a client that
    closes the stream cancels the request, its KV freed."""
    import urllib.request

    from tests.integration.test_services import wait_idle

    assert wait_idle(cluster)
    body = {"model": TINY_MODEL_ID, "stream": True, "ignore_eos": True, "speculation": "on"}
    if door == "responses":
        body |= {"input": "abc", "max_output_tokens": 300}
    else:
        body |= {"messages": [{"role": "user", "content": "abc"}], "max_tokens": 300}
    request = urllib.request.Request(
        f"{cluster.http}/v1/{door}",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as stream:
        deltas = 0
        while deltas < 5:
            line = stream.readline()
            deltas += b"delta" in line
        assert sum(e.scheduler.batch for e in cluster.engines) == 1  # still generating
    assert wait_idle(cluster), "KV blocks or drafter sessions were not released"
    assert len(aborts) == 1, "the request ran on after its client left"
