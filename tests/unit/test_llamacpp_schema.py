"""llama-server's bodies (router/llamacpp_schema.py) and answers' stop rules
(router/llamacpp_answer.py): defaults, the sampler chain as specd's parameters, refusals
naming the field, and n_indent's cut."""

import json
from types import SimpleNamespace

import pytest

from router.body import BodyError, parse
from router.llamacpp_answer import LlamaAnswer
from router.llamacpp_schema import InfillBody, LlamaCompletionBody


def body(**fields) -> LlamaCompletionBody:
    return parse(json.dumps(fields).encode(), LlamaCompletionBody)


def test_llama_servers_defaults_and_order():
    """No samplers named: llama.cpp's chain, the temperature after the truncations."""
    order = body(prompt="x").sampler_order()
    assert order == {
        "top_k": 40,
        "top_p": 0.95,
        "min_p": 0.05,
        "temperature": 0.8,
        "temperature_last": True,
        "infill": False,
    }
    assert body(prompt="x").max_new_tokens() == -1  # until the context is full


def test_llama_vscodes_samplers():
    """What llama.vscode sends to /infill: no temperature listed, so 1; min_p not listed,
    so off; the infill sampler on."""
    order = body(prompt="x", top_k=40, top_p=0.99, samplers=["top_k", "top_p", "infill"])
    assert order.sampler_order() == {
        "top_k": 40,
        "top_p": 0.99,
        "min_p": 0.0,
        "temperature": 1.0,
        "temperature_last": False,
        "infill": True,
    }
    # the letters spell the same chain; the temperature first is vLLM's order
    assert body(prompt="x", samplers="kpi").sampler_order()["infill"]
    assert not body(prompt="x", samplers="tkpm").sampler_order()["temperature_last"]


@pytest.mark.parametrize(
    "samplers,message",
    [
        (["top_p", "top_k"], "order"),  # top-p before top-k
        (["top_p", "temperature", "min_p"], "temperature"),  # between the truncations
        (["top_k", "top_k"], "once"),
        (["mirostat"], "unknown"),
    ],
)
def test_an_order_specd_does_not_apply_is_refused(samplers, message):
    with pytest.raises(BodyError, match=message) as err:
        body(prompt="x", samplers=samplers).sampler_order()
    assert err.value.param == "samplers"


def test_greedy_with_the_infill_sampler():
    # the temperature first and greedy: one token left, which the infill sampler keeps
    first = body(prompt="x", temperature=0, samplers=["temperature", "top_k", "infill"])
    assert first.sampler_order()["infill"] is False
    last = body(prompt="x", temperature=0, samplers=["top_k", "infill", "temperature"])
    with pytest.raises(BodyError, match="greedy"):
        last.sampler_order()


@pytest.mark.parametrize(
    "field,value",
    [
        ("repeat_penalty", 1.1),
        ("dry_multiplier", 0.8),
        ("mirostat", 2),
        ("typical_p", 0.9),
        ("post_sampling_probs", True),
        ("lora", [{"id": 0, "scale": 0.5}]),
    ],
)
def test_samplers_specd_has_not_are_refused_only_when_on(field, value):
    with pytest.raises(BodyError) as err:
        body(prompt="x", **{field: value})
    assert err.value.param == field
    off = {"repeat_penalty": 1.0, "dry_multiplier": 0.0, "mirostat": 0, "typical_p": 1.0}
    if field in off:
        body(prompt="x", **{field: off[field]})  # the default is accepted


def test_logit_bias_pairs_and_objects():
    assert body(prompt="x", logit_bias=[[15, 1.5], ["ab", False]]).bias_items() == [
        (15, 1.5),
        ("ab", -100.0),
    ]
    assert body(prompt="x", logit_bias={"15": -2}).bias_items() == [(15, -2.0)]
    with pytest.raises(BodyError, match="logit_bias"):
        body(prompt="x", logit_bias=[[15, 500]]).bias_items()


def test_prompts_one_or_several():
    assert body(prompt=[1, "ab", 2]).prompts() == [[1, "ab", 2]]  # one prompt, mixed
    assert body(prompt=["ab", [1, 2]]).prompts() == ["ab", [1, 2]]  # two
    with pytest.raises(BodyError, match="unknown field"):
        parse(b'{"input_prefix": "a", "input_suffix": "b", "nope": 1}', InfillBody)
    with pytest.raises(BodyError, match="input_suffix"):
        parse(b'{"input_prefix": "a"}', InfillBody)


def answer(n_indent: int) -> LlamaAnswer:
    return LlamaAnswer(body(prompt="x", n_indent=n_indent), "m", "x", 1, lambda ids: "")


def message(text: str):
    return SimpleNamespace(text=text, token_ids=[1], logprobs=[], finish_reason="")


def test_n_indent_cuts_the_first_line_indented_less():
    """As llama-server: the first line (the cursor's) is never cut; a later line with less
    indentation ends the output before its text, its indentation kept; a blank line
    counts as no indentation."""
    a = answer(4)
    sent = [a.feed(message(t))["content"] for t in ["x = 1", "\n    y", " = 2\n", "  z"]]
    assert sent == ["x = 1", "\n    y", " = 2\n", "  "] and a.done
    assert a.content == "x = 1\n    y = 2\n  "
    assert a.final(None, streamed=False)["stop_type"] == "limit"
    b = answer(4)
    b.feed(message("a\n    b\n\nc"))  # one message, three lines: the blank one cuts
    assert b.content == "a\n    b\n" and b.done
    c = answer(0)
    c.feed(message("a\nb"))
    assert not c.done and c.content == "a\nb"


def test_t_max_predict_ms_ends_at_a_newline_once_past_it():
    a = LlamaAnswer(body(prompt="x", t_max_predict_ms=50), "m", "x", 1, lambda ids: "")
    a.feed(message("a"))
    a.t_first -= 1.0  # a second since the first token
    a.feed(message("b c"))  # past the limit, but no newline yet
    assert not a.done
    a.feed(message("d\n"))
    assert a.done and a.content == "ab cd\n"
    assert a.final(None, streamed=False)["stop_type"] == "limit"


# llama.vscode's chat edit, as it posts it to /v1/chat/completions
CHAT_EDIT = {
    "messages": [{"role": "user", "content": "Rename x to y."}],
    "stream": False,
    "cache_prompt": True,
    "samplers": "edkypmxt",
    "temperature": 0.8,
    "dynatemp_range": 0,
    "dynatemp_exponent": 1,
    "top_k": 40,
    "top_p": 0.95,
    "min_p": 0.05,
    "typical_p": 1,
    "xtc_probability": 0,
    "xtc_threshold": 0.1,
    "repeat_last_n": 64,
    "repeat_penalty": 1,
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "dry_multiplier": 0,
    "dry_base": 1.75,
    "dry_allowed_length": 2,
    "dry_penalty_last_n": -1,
    "max_tokens": -1,
    "timings_per_token": False,
}


def test_llama_servers_fields_on_the_openai_door():
    """A client written for llama-server's OpenAI endpoints sends its sampler fields there
    too: served with its chain (temperature last), -1 tokens until the context is full."""
    from router.openai_request import to_request
    from router.openai_schema import ChatBody, CompletionBody

    chat = parse(json.dumps({"model": "m", **CHAT_EDIT}).encode(), ChatBody)
    request = to_request(chat)
    assert request.max_new_tokens == -1
    p = request.params
    assert (p.temperature, p.top_k, p.min_p) == (pytest.approx(0.8), 40, pytest.approx(0.05))
    assert p.temperature_last and not p.infill
    plain = to_request(parse(b'{"model": "m", "prompt": "x", "temperature": 0.8}', CompletionBody))
    assert not plain.params.temperature_last  # no samplers: vLLM's order, as before
    with pytest.raises(BodyError) as err:
        parse(json.dumps({"model": "m", **CHAT_EDIT, "dry_multiplier": 0.8}).encode(), ChatBody)
    assert err.value.param == "dry_multiplier"


def test_the_completion_it_stands_for_carries_its_chain():
    """/completion and /infill reach the verifier through the OpenAI door's mapping of
    `samplers`: llama.cpp's default chain (temperature last), llama.vscode's (infill)."""
    from router.openai_request import to_request

    default = to_request(body(prompt="x").completion_body([1, 2], {})).params
    assert default.temperature_last and not default.infill
    assert (default.top_k, default.top_p) == (40, pytest.approx(0.95))
    vscode = body(prompt="x", top_p=0.99, samplers=["top_k", "top_p", "infill"])
    p = to_request(vscode.completion_body([1, 2], {})).params
    assert p.infill and (p.temperature, p.min_p, p.top_p) == (1.0, 0.0, pytest.approx(0.99))


def test_tokenize_reads_special_tokens_as_llama_server_does():
    """/tokenize's `parse_special` (default true): a special token's text is the token;
    false, it is text. Ids in `content` stay as they are."""
    from types import SimpleNamespace

    from router.llamacpp_http import LlamaCppRoutes
    from router.tokenizer import ChatTokenizer
    from specd.models.catalog import DEFAULT_TARGET
    from tests.conftest import real_model_or_skip

    routes = LlamaCppRoutes.__new__(LlamaCppRoutes)  # its tokenizing only
    routes.router = SimpleNamespace(tokenizer=ChatTokenizer(real_model_or_skip(DEFAULT_TARGET)))
    special = routes._mixed_ids(["<|im_start|>user", 42], add_special=False)
    assert special[0] == 151644 and special[-1] == 42
    text = routes._mixed_ids(["<|im_start|>user", 42], add_special=False, split_special=True)
    assert 151644 not in text and len(text) > len(special) and text[-1] == 42
