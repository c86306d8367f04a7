"""The router's torch-free tokenizer (router/tokenizer.py) against transformers', token for
token: every workload conversation through each model's chat template, prompts, decoding
and the vocabulary's size."""

from __future__ import annotations

import json
import random

import pytest
from transformers import AutoTokenizer

from bench.prompts import WORKLOADS, load_conversations
from router.tokenize_http import tokenizer_info
from router.tokenizer import ChatTokenizer
from specd.chat_template import read_chat_template
from specd.config import RouterConfig
from specd.models.catalog import DEFAULT_TARGET
from tests.cluster import char_tokenizer
from tests.conftest import real_model_or_skip

CONVERSATIONS = [c for path in sorted(WORKLOADS.glob("*.jsonl")) for c in load_conversations(path)]
# roles and turns the workloads do not have: a system prompt, a multi-turn exchange
CONVERSATIONS += [
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a prime."},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": "Another, ünïcödé and all: 日本語?"},
    ]
]


# what the real templates above do not lean on: block trimming, special tokens by name, loop
# controls, `tojson` on non-ASCII, filters, a variable of the request's (chat_template_kwargs)
PICKY_TEMPLATE = """{{ bos_token }}
{% for m in messages %}
    {% if m['role'] == 'system' %}{% continue %}{% endif %}
<{{ m['role'] }}>
    {{ m['content'] | trim }}{{ eos_token }}
{% endfor %}
{% if add_generation_prompt %}<assistant>
{% endif %}
{{ messages[-1] | tojson }}{% if greeting is defined %} {{ greeting }}{% endif %}
"""


@pytest.fixture(
    scope="module",
    params=[
        pytest.param("small", marks=pytest.mark.real),
        pytest.param("default", marks=pytest.mark.real),
        "char",
        "picky",
    ],
)
def pair(request, tmp_path_factory):
    """(ours, transformers') for the small real model, the default target, the tiny
    models' character tokenizer with its template (tests/cluster.py), and that tokenizer
    with special tokens and a template that tests the rendering environment."""
    if request.param in ("char", "picky"):
        folder = tmp_path_factory.mktemp("char-tokenizer")
        char_tokenizer().save_pretrained(folder)
        if request.param == "picky":
            config = json.loads((folder / "tokenizer_config.json").read_text())
            # the end token as older configs write one: an AddedToken's fields
            end = {"__type": "AddedToken", "content": "}", "lstrip": False, "special": True}
            config |= {"bos_token": "{", "eos_token": end}
            (folder / "tokenizer_config.json").write_text(json.dumps(config))
            (folder / "chat_template.jinja").write_text(PICKY_TEMPLATE)
    else:
        name = "smollm2-135m-instruct" if request.param == "small" else DEFAULT_TARGET
        folder = real_model_or_skip(name)
    return ChatTokenizer(folder), AutoTokenizer.from_pretrained(folder)


def test_every_workload_conversation_renders_to_transformers_tokens(pair):
    ours, theirs = pair
    assert len(CONVERSATIONS) > 40  # every workload read
    for messages in CONVERSATIONS:
        want = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        want = list(want["input_ids"] if hasattr(want, "keys") else want)
        assert ours.apply_chat_template(messages, add_generation_prompt=True) == want, messages
        text = theirs.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
        assert ours.apply_chat_template(messages, False, tokenize=False) == text


def test_prompts_decoding_and_the_vocabulary_match(pair):
    ours, theirs = pair
    assert len(ours) == len(theirs)
    assert ours.name_or_path == theirs.name_or_path  # the folder (SGLang's tokenizer_path)
    for messages in CONVERSATIONS[::7]:
        text = messages[-1]["content"]
        want = theirs(text, add_special_tokens=False)["input_ids"]
        assert ours(text, add_special_tokens=False)["input_ids"] == want
    rng = random.Random(0)
    for _ in range(200):  # any ids, special ones included, split characters and all
        ids = [rng.randrange(len(theirs)) for _ in range(rng.randrange(1, 12))]
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
                ids, skip_special_tokens=skip
            ), (ids, skip)


def test_a_template_that_raises_is_an_error_and_no_template_is_refused(tmp_path):
    char_tokenizer().save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("{{ raise_exception('no system role') }}")
    with pytest.raises(Exception, match="no system role"):
        ChatTokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "hi"}])
    (tmp_path / "chat_template.jinja").unlink()
    with pytest.raises(ValueError, match="no chat template"):
        ChatTokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "hi"}])


def test_a_template_given_in_place_of_the_models_renders_every_chat(tmp_path):
    """vLLM's --chat-template: the template set on the tokenizer renders every chat from
    then on, as transformers' does with its chat_template set, and is the one reported."""
    char_tokenizer().save_pretrained(tmp_path)
    ours, theirs = ChatTokenizer(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    chat = [{"role": "user", "content": "hi"}]
    before = ours.apply_chat_template(chat, tokenize=False)
    ours.chat_template = theirs.chat_template = PICKY_TEMPLATE
    assert ours.apply_chat_template(chat, tokenize=False) != before
    for messages in CONVERSATIONS[::5]:
        for tokenize in (True, False):
            want = theirs.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=tokenize
            )
            want = list(want["input_ids"]) if hasattr(want, "keys") else want
            assert ours.apply_chat_template(messages, True, tokenize=tokenize) == want
    assert tokenizer_info(ours)["chat_template"] == PICKY_TEMPLATE


def test_a_chat_template_is_read_from_a_file_or_as_its_text(tmp_path):
    path = tmp_path / "tool_chat.jinja"
    path.write_text(PICKY_TEMPLATE)
    assert read_chat_template(str(path)) == PICKY_TEMPLATE
    one_line = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
    assert read_chat_template(one_line) == one_line
    with pytest.raises(ValueError, match="no file 'chatml', and it is not a template's text"):
        read_chat_template("chatml")
    with pytest.raises(ValueError, match=r"^chat_template: line 1: .*endfor"):
        read_chat_template("{% for m in messages %}")
    with pytest.raises(ValueError, match="no file"):  # refused before a router starts
        RouterConfig(chat_template=str(tmp_path / "missing.jinja"))


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city, ünïcödé",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
TOOL_CHAT = [  # a call made, answered, and the model's turn again
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear"}'},
]


def test_tools_and_tool_calls_render_to_transformers_tokens(pair):
    ours, theirs = pair
    for messages in (TOOL_CHAT[:1], TOOL_CHAT):
        kw = {"tools": TOOLS, "add_generation_prompt": True, "tokenize": False}
        assert ours.apply_chat_template(messages, **kw) == theirs.apply_chat_template(
            messages, **kw
        )
    if "tools" in str(ours.chat_template):  # the template renders them
        with_tools = ours.apply_chat_template(TOOL_CHAT[:1], tokenize=False, tools=TOOLS)
        assert "get_weather" in with_tools
        assert with_tools != ours.apply_chat_template(TOOL_CHAT[:1], tokenize=False)


def test_continuing_the_last_message_and_template_variables_render_as_transformers(pair):
    ours, theirs = pair
    kw = {"add_generation_prompt": False, "continue_final_message": True, "tokenize": False}
    for messages in CONVERSATIONS[::5]:
        chat = [*messages, {"role": "assistant", "content": "Sure, here is "}]
        text = ours.apply_chat_template(chat, **kw)
        assert text == theirs.apply_chat_template(chat, **kw)
        assert text.rstrip().endswith("Sure, here is")  # a template may strip it
    chat = CONVERSATIONS[0]
    kw = {"add_generation_prompt": True, "tokenize": False, "greeting": "hello there"}
    text = ours.apply_chat_template(chat, **kw)
    assert text == theirs.apply_chat_template(chat, **kw)
    assert ("hello there" in text) == ("greeting" in str(ours.chat_template))
    with pytest.raises(ValueError, match="exclude each other"):
        ours.apply_chat_template(chat, add_generation_prompt=True, continue_final_message=True)


def test_tokenizer_info_answers_as_vllm_answers_from_transformers_tokenizer(pair):
    """/tokenizer_info from the router's tokenizer equals what it makes of transformers'
    (vLLM's answer, less the paths of its files): every setting, the special tokens and
    added tokens as text, the template; how transformers was asked to load it aside."""
    ours, theirs = pair
    loading = ("is_local", "local_files_only")  # from_pretrained's arguments it records
    got, want = (json.loads(json.dumps(tokenizer_info(t))) for t in (ours, theirs))
    assert {k: v for k, v in got.items() if k not in loading} == {
        k: v for k, v in want.items() if k not in loading
    }
    assert got["chat_template"] == theirs.chat_template
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        assert got.get(name) == getattr(theirs, name)
    assert got["added_tokens_decoder"]  # tokenizer.json's added tokens, by id
    assert not {"vocab_file", "merges_file", "tokenizer_file", "name_or_path"} & set(got)
