"""What an OpenAI body's absent sampling fields mean: the model's recommended values from
its generation_config.json (as vLLM and SGLang serve them), else the OpenAI API's."""

import json

from router.body import parse
from router.openai_request import OPENAI_DEFAULTS, SamplingDefaults, to_request
from router.openai_schema import ChatBody, CompletionBody

QWEN = {  # as Qwen2.5's instruct models ship it
    "bos_token_id": 151643,
    "do_sample": True,
    "eos_token_id": [151645, 151643],
    "repetition_penalty": 1.05,
    "temperature": 0.7,
    "top_k": 20,
    "top_p": 0.8,
}


def body(kind=ChatBody, **fields):
    base = {"model": "m"}
    base.update(
        {"messages": [{"role": "user", "content": "hi"}]} if kind is ChatBody else {"prompt": "hi"}
    )
    return parse(json.dumps(base | fields).encode(), kind)


def folder_with(tmp_path, config) -> SamplingDefaults:
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return SamplingDefaults.from_folder(tmp_path)


def test_a_models_recommended_values_fill_what_a_request_leaves_out(tmp_path):
    defaults = folder_with(tmp_path, QWEN)
    assert defaults == SamplingDefaults(0.7, 0.8, 20, None, 1.05)
    for kind in (ChatBody, CompletionBody):
        p = to_request(body(kind), defaults=defaults).params
        assert (round(p.temperature, 6), round(p.top_p, 6), p.top_k, p.min_p) == (0.7, 0.8, 20, 0)
        assert round(p.repetition_penalty, 6) == 1.05
    # what a request names is its own, greedy and "off" included
    p = to_request(
        body(temperature=0, top_k=-1, top_p=1, repetition_penalty=1.0), defaults=defaults
    ).params
    assert (p.temperature, p.top_k, p.top_p, p.repetition_penalty) == (0, 0, 1, 1)


def test_without_recommended_values_the_openai_apis_defaults(tmp_path):
    gguf = {"bos_token_id": 1, "eos_token_id": 2}  # what a GGUF's conversion writes
    for defaults in (
        folder_with(tmp_path, gguf),
        SamplingDefaults.from_folder(tmp_path / "none"),
        OPENAI_DEFAULTS,
    ):
        assert defaults == OPENAI_DEFAULTS
        p = to_request(body(), defaults=defaults).params
        assert (p.temperature, p.top_p, p.top_k, p.min_p) == (1, 0, 0, 0)
        assert not p.HasField("repetition_penalty")


def test_values_a_request_could_not_send_are_not_taken(tmp_path):
    bad = {"temperature": -1, "top_p": 0, "top_k": 2.5, "min_p": "0.1", "repetition_penalty": True}
    assert folder_with(tmp_path, bad) == OPENAI_DEFAULTS
    (tmp_path / "generation_config.json").write_text("{not json")
    assert SamplingDefaults.from_folder(tmp_path) == OPENAI_DEFAULTS
