"""Tool calls read out of a model's text (router/tools.py): each format vLLM's parser of that
name reads, whole and streamed in any pieces alike, what is not a call kept as content; the
schema a forced choice constrains the output to; the checks on a choice."""

import json
import random

import jsonschema
import pytest

from router.tools import HERMES, LLAMA3_JSON, Call, ToolUse, call_format, format_of

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


def use(choice="auto", call_format=HERMES, parallel=True) -> ToolUse:
    return ToolUse([WEATHER, TIME], choice, parallel, call_format)


def read_whole(tools: ToolUse, text: str) -> tuple[str, list[tuple[str, dict]]]:
    reader = tools.reader()
    content, calls = reader.feed(text)
    more, last = reader.flush()
    return content + more, [(c.name, json.loads(c.arguments)) for c in calls + last]


def read_streamed(tools: ToolUse, text: str, rng: random.Random):
    reader, content, calls, at = tools.reader(), "", [], 0
    while at < len(text):
        step = rng.randrange(1, 6)
        piece, got = reader.feed(text[at : at + step])
        content, calls, at = content + piece, calls + got, at + step
    piece, got = reader.flush()
    return content + piece, [(c.name, json.loads(c.arguments)) for c in calls + got]


PARIS = {"city": "Paris", "unit": "c"}
DEEP = '{"a": ' + "[" * 5000 + "]" * 5000 + "}"
HERMES_CASES = [
    # (model text, content, calls)
    ("It is sunny.", "It is sunny.", []),
    (
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris", "unit": "c"}}\n</tool_call>',
        "Let me look.\n",
        [("get_weather", PARIS)],
    ),
    (  # two calls: the whitespace between them is not content
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
        "\n</tool_call>",
        "",
        [("get_time", {}), ("get_weather", PARIS)],
    ),
    (  # not JSON: kept as the model wrote it
        "<tool_call>\nget_weather(Paris)\n</tool_call> done",
        "<tool_call>\nget_weather(Paris)\n</tool_call> done",
        [],
    ),
    (  # the model stopped before closing its call
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n',
        "",
        [("get_time", {})],
    ),
    ('<tool_call>\n{"name": "get_ti', '<tool_call>\n{"name": "get_ti', []),  # cut short
    ("a <tool> and a <tool_cal", "a <tool> and a <tool_cal", []),  # tags it is not
    (
        '<tool_call>{"name": "get_time", "parameters": {"x": 1}}</tool_call>',
        "",
        [("get_time", {"x": 1})],
    ),
    # a model's text nested past the parser's limit: text, never a RecursionError
    (f"<tool_call>{DEEP}</tool_call>", f"<tool_call>{DEEP}</tool_call>", []),
]


@pytest.mark.parametrize("text, content, calls", HERMES_CASES)
def test_hermes_calls_and_content_whole_and_streamed(text, content, calls):
    assert read_whole(use(), text) == (content, calls)
    rng = random.Random(0)
    for _ in range(20):
        assert read_streamed(use(), text, rng) == (content, calls)


def test_without_parallel_calls_auto_keeps_the_first_call_only():
    text = HERMES_CASES[2][0]  # two calls
    one = use(parallel=False)
    assert read_whole(one, text) == ("", [("get_time", {})])
    assert read_streamed(one, text, random.Random(2)) == ("", [("get_time", {})])
    assert read_whole(one, HERMES_CASES[1][0]) == HERMES_CASES[1][1:]  # one call: as it was


def test_hermes_streams_content_before_a_call_and_holds_only_what_might_open_one():
    reader = use().reader()
    assert reader.feed("Sure. <tool") == ("Sure. ", [])  # "<tool" might open a call
    assert reader.feed("box> is") == ("<toolbox> is", [])
    assert reader.feed(' <tool_call>{"name": "get_time", ') == (" ", [])
    content, calls = reader.feed('"arguments": {}}</tool_call>')
    assert content == "" and [c.name for c in calls] == ["get_time"]


LLAMA_CASES = [
    (
        '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}',
        "",
        [("get_weather", PARIS)],
    ),
    (
        ' {"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": '
        '{"city": "Paris", "unit": "c"}}',
        "",
        [("get_time", {}), ("get_weather", PARIS)],
    ),
    ("The weather is {sunny}.", "The weather is {sunny}.", []),
    ('{"answer": 42}', '{"answer": 42}', []),  # JSON, but not a call
    (DEEP, DEEP, []),
    (
        '{"name": "get_time", "parameters": {}} and more',
        '{"name": "get_time", "parameters": {}} and more',
        [],
    ),
]


@pytest.mark.parametrize("text, content, calls", LLAMA_CASES)
def test_llama3_json_calls_whole_and_streamed(text, content, calls):
    tools = use(call_format=LLAMA3_JSON)
    assert read_whole(tools, text) == (content, calls)
    rng = random.Random(1)
    for _ in range(20):
        assert read_streamed(tools, text, rng) == (content, calls)


def test_llama3_json_text_streams_as_it_comes():
    reader = use(call_format=LLAMA3_JSON).reader()
    assert reader.feed("  ") == ("", [])
    assert reader.feed("Hi") == ("  Hi", [])
    assert reader.feed(" {") == (" {", [])


def test_required_and_named_choices_read_the_constrained_output():
    required = json.dumps(
        [{"name": "get_weather", "parameters": PARIS}, {"name": "get_time", "parameters": {}}]
    )
    assert read_whole(use("required"), required) == ("", [("get_weather", PARIS), ("get_time", {})])
    assert read_whole(use("required"), required[:30]) == (required[:30], [])  # cut by length
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert read_whole(use(named), '{"city": "Oslo"}') == ("", [("get_weather", {"city": "Oslo"})])
    assert read_whole(use("none"), "<tool_call>{}</tool_call>") == ("<tool_call>{}</tool_call>", [])


def test_a_choice_that_called_finishes_as_openai_says():
    named = use({"type": "function", "function": {"name": "get_weather"}})
    assert use("auto").finish("stop", True) == use("auto").finish("length", True) == "tool_calls"
    assert use("required").finish("stop", True) == "tool_calls"
    assert use("required").finish("length", True) == "length"  # cut: not a finished call
    assert named.finish("stop", True) == "stop"
    assert use("auto").finish("stop", False) == use("none").finish("stop", False) == "stop"


def test_the_schema_a_forced_choice_constrains_the_output_to():
    named = use({"type": "function", "function": {"name": "get_weather"}})
    assert named.schema() == WEATHER["function"]["parameters"]
    no_parameters = use({"type": "function", "function": {"name": "get_time"}}).schema()
    jsonschema.validate({}, no_parameters)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"x": 1}, no_parameters)
    assert use("auto").schema() is None and use("none").schema() is None
    schema = use("required").schema()
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Oslo"}}], schema)
    jsonschema.validate([{"name": "get_time", "parameters": {}}] * 2, schema)
    for bad in (
        [],
        [{"name": "get_rain", "parameters": {}}],
        [{"name": "get_weather", "parameters": {}}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    one = use("required", parallel=False).schema()
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "parameters": {}}] * 2, one)


def test_a_choice_is_checked():
    with pytest.raises(ValueError, match="get_rain"):
        use({"type": "function", "function": {"name": "get_rain"}})
    with pytest.raises(ValueError, match="auto"):
        use("auto", call_format=None)
    use("required", call_format=None)  # any model can be made to call


def test_the_call_format_comes_from_the_template():
    assert format_of("{{ '<tool_call>' }}") == HERMES
    assert format_of("{{ '<|python_tag|>' }}") == LLAMA3_JSON
    assert (
        format_of('{"name": function name, "parameters": dictionary of argument name}')
        == LLAMA3_JSON
    )
    assert format_of("{{ messages }}") is None and format_of(None) is None
    # the router's --tool-call-parser names one, or leaves it to the template
    assert call_format("auto", "<tool_call>") == HERMES
    assert call_format("llama3_json", "<tool_call>") == LLAMA3_JSON
    assert call_format("hermes", None) == HERMES
    with pytest.raises(ValueError, match="hermes"):
        call_format("mistral", None)


def test_calls_have_their_own_ids_in_the_openai_shape():
    a, b = Call("f", "{}"), Call("f", "{}")
    assert a.id != b.id and a.id.startswith("call_")
    assert a.as_dict(2) == {
        "index": 2,
        "id": a.id,
        "type": "function",
        "function": {"name": "f", "arguments": "{}"},
    }
