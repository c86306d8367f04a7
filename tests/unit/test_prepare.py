"""The router's check of a request's token limits (router/prepare.py): the default where a
request names none, and a cap only where the operator sets one; otherwise the verifier
bounds a request by what it serves (its context and KV pool: test_engine.py)."""

import grpc
import pytest

from protos.specd.v1.router_pb2 import GenerateRequest
from router.policy import Policy
from router.prepare import Preparer, RequestError
from router.tokenizer import ChatTokenizer
from tests.cluster import CHAT_TEMPLATE, char_tokenizer


def test_max_new_tokens_is_capped_only_where_the_operator_says():
    uncapped = Preparer(char_tokenizer(), Policy.builtin(), 256, 0)
    assert uncapped.prepare(GenerateRequest(prompt="ab"), {}).max_new_tokens == 256
    many = GenerateRequest(prompt="ab", max_new_tokens=100_000)
    assert uncapped.prepare(many, {}).max_new_tokens == 100_000
    capped = Preparer(char_tokenizer(), Policy.builtin(), 256, 100)
    at_cap = GenerateRequest(prompt="ab", max_new_tokens=100)
    assert capped.prepare(at_cap, {}).max_new_tokens == 100
    for preparer, over in ((capped, 101), (uncapped, -2)):
        with pytest.raises(RequestError) as err:
            preparer.prepare(GenerateRequest(prompt="ab", max_new_tokens=over), {})
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "max_new_tokens" in str(err.value)


@pytest.mark.parametrize("kind", ["transformers", "router"])
def test_a_developer_message_is_a_system_message_where_the_template_has_no_developer(
    tmp_path, kind
):
    """OpenAI's clients send their newer models' system prompt as role "developer"."""
    tok = char_tokenizer()
    if kind == "router":  # the router process's own tokenizer, read from a saved folder
        tok.save_pretrained(tmp_path)
        tok = ChatTokenizer(tmp_path)
    request = GenerateRequest()
    request.messages.messages.add(role="developer", content="Be brief.")
    request.messages.messages.add(role="user", content="hi")
    preparer = Preparer(tok, Policy.builtin(), 16, 0)
    text = tok.decode(preparer.prepare(request, {}).prompt_ids)
    assert text == "system: Be brief.?user: hi?assistant: "  # "?": a newline, not in the vocabulary
    tok.chat_template = "{# developer #}" + CHAT_TEMPLATE  # the word alone: not the role
    assert tok.decode(preparer.prepare(request, {}).prompt_ids).startswith("system: ")
    tok.chat_template = "{# m.role == 'developer' #}" + CHAT_TEMPLATE  # it names the role
    if kind == "router":
        (tmp_path / "chat_template.jinja").write_text(tok.chat_template)
        tok = preparer.tokenizer = ChatTokenizer(tmp_path)
    text = tok.decode(preparer.prepare(request, {}).prompt_ids)
    assert text == "developer: Be brief.?user: hi?assistant: "
    request.messages.messages.add(role="wizard", content="x")
    with pytest.raises(RequestError) as err:
        preparer.prepare(request, {})
    assert "wizard" in str(err.value) and "developer" in str(err.value)


def test_minus_one_asks_for_what_the_context_leaves_or_the_operators_cap():
    """-1 (llama.cpp's n_predict -1; the OpenAI door's chat without a limit) travels to the
    verifier, which alone knows its context (openai_api/test_http); a cap, where set, binds it."""
    until = GenerateRequest(prompt="ab", max_new_tokens=-1)
    assert (
        Preparer(char_tokenizer(), Policy.builtin(), 256, 0).prepare(until, {}).max_new_tokens == -1
    )
    capped = Preparer(char_tokenizer(), Policy.builtin(), 256, 100)
    assert capped.prepare(until, {}).max_new_tokens == 100
    with pytest.raises(RequestError) as err:
        capped.prepare(GenerateRequest(prompt="ab", max_new_tokens=-2), {})
    assert "-1" in str(err.value)


def test_a_raw_prompt_gets_the_special_tokens_its_tokenizer_adds_as_in_vllm(tmp_path):
    """A Llama tokenizer adds its BOS to a raw prompt, as vLLM's and llama.cpp's
    completions do (a chat's template writes its own); the router's torch-free tokenizer
    the same as transformers'."""
    from tokenizers import processors

    tok = char_tokenizer()
    bos = tok.convert_tokens_to_ids("~")  # the character vocabulary's stand-in BOS
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="~ $A", special_tokens=[("~", bos)]
    )
    tok.save_pretrained(tmp_path)
    request = GenerateRequest(prompt="abc", max_new_tokens=1)
    for t in (tok, ChatTokenizer(tmp_path)):
        ids = Preparer(t, Policy.builtin(), 16, 0).prepare(request, {}).prompt_ids
        assert ids == [bos, *tok("abc", add_special_tokens=False)["input_ids"]]
    chat = GenerateRequest(max_new_tokens=1)
    chat.messages.messages.add(role="user", content="abc")
    ids = Preparer(tok, Policy.builtin(), 16, 0).prepare(chat, {}).prompt_ids
    assert bos not in ids  # the template's text, tokenized as it stands


@pytest.mark.parametrize("kind", ["transformers", "router"])
def test_a_chat_continues_its_last_message_and_hands_the_template_its_variables(tmp_path, kind):
    """vLLM's continue_final_message, add_generation_prompt and chat_template_kwargs, as
    gRPC carries them, through either tokenizer the router may hold."""
    tok = char_tokenizer()
    tok.chat_template = "{{ greeting | default('') }}" + CHAT_TEMPLATE
    if kind == "router":
        tok.save_pretrained(tmp_path)
        tok = ChatTokenizer(tmp_path)
    preparer = Preparer(tok, Policy.builtin(), 16, 0)
    request = GenerateRequest()
    request.messages.messages.add(role="user", content="hi")
    request.messages.messages.add(role="assistant", content="Sure")

    def prompt() -> str:
        return tok.decode(preparer.prepare(request, {}).prompt_ids)

    assert prompt() == "user: hi?assistant: Sure?assistant: "  # "?": a newline
    request.messages.continue_final_message = True
    assert prompt() == "user: hi?assistant: Sure"
    request.messages.chat_template_kwargs_json = '{"greeting": "Hello. "}'
    assert prompt() == "Hello. user: hi?assistant: Sure"
    request.messages.continue_final_message = False
    request.messages.add_generation_prompt = False
    assert prompt() == "Hello. user: hi?assistant: Sure?"
    request.messages.continue_final_message = True
    request.messages.add_generation_prompt = True
    for kwargs, said in [("", "add_generation_prompt"), ('{"messages": []}', "may not set")]:
        request.messages.chat_template_kwargs_json = kwargs
        request.messages.add_generation_prompt = not kwargs
        with pytest.raises(RequestError) as err:
            preparer.prepare(request, {})
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and said in str(err.value)
    request.messages.chat_template_kwargs_json = "[1]"
    with pytest.raises(RequestError, match="JSON object"):
        preparer.prepare(request, {})


def test_stop_token_ids_and_min_tokens_are_checked_before_a_replica_sees_them():
    preparer = Preparer(char_tokenizer(), Policy.builtin(), 16, 0)
    for request, said in [
        (GenerateRequest(prompt="ab", stop_token_ids=[96]), "stop_token_ids"),
        (GenerateRequest(prompt="ab", stop_token_ids=[-1]), "stop_token_ids"),
        (GenerateRequest(prompt="ab", max_new_tokens=4, params={"min_tokens": 5}), "min_tokens"),
        (GenerateRequest(prompt="ab", params={"min_tokens": -1}), "min_tokens"),
    ]:
        with pytest.raises(RequestError, match=said) as err:
            preparer.prepare(request, {})
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    until_context = GenerateRequest(prompt="ab", max_new_tokens=-1, params={"min_tokens": 50})
    assert preparer.prepare(until_context, {}).params.min_tokens == 50


def test_bad_words_become_token_ids_as_vllm_spells_them():
    """Each word as it stands and, where a space before it makes another first token of
    as many tokens, as a word inside the text (Qwen's " hello" is one token, not two);
    the ids land in params.bad_words, which the verifier bans."""
    from specd.models.catalog import DEFAULT_TARGET
    from tests.conftest import real_model_or_skip

    tokenizer = ChatTokenizer(real_model_or_skip(DEFAULT_TARGET))
    preparer = Preparer(tokenizer, Policy.builtin(), 16, 0)
    ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    prep = preparer.prepare(GenerateRequest(prompt="x", bad_words=["hello", " import os"]), {})
    words = [list(w) for w in prep.params.bad_words]
    assert words == [ids("hello"), ids(" hello"), ids("import os"), ids(" import os")]
    assert ids("hello") != ids(" hello") and len(ids(" hello")) == 1
    chars = Preparer(char_tokenizer(), Policy.builtin(), 16, 0)  # " ab" is 3 tokens: one way
    words = chars.prepare(GenerateRequest(prompt="x", bad_words=["ab"]), {}).params.bad_words
    assert [list(w) for w in words] == [char_tokenizer()("ab")["input_ids"]]


@pytest.mark.parametrize("field", ["tools_json", "chat_template_kwargs_json", "arguments"])
def test_json_in_a_chat_nested_too_deeply_is_refused_not_recursed(field):
    """The gRPC door's JSON fields parse with a depth limit (specd/json_text.py): a client's
    100,000-deep text is INVALID_ARGUMENT, never a RecursionError (gRPC's UNKNOWN)."""
    deep = "[" * 100_000 + "]" * 100_000
    request = GenerateRequest()
    request.messages.messages.add(role="user", content="hi")
    if field == "arguments":  # an earlier call's arguments: kept as the text they are
        call = request.messages.messages.add(role="assistant").tool_calls.add(name="f")
        call.arguments = deep
    else:
        setattr(request.messages, field, deep)
    preparer = Preparer(char_tokenizer(), Policy.builtin(), 16, 0)
    if field == "arguments":
        assert preparer.prepare(request, {}).prompt_ids
        return
    with pytest.raises(RequestError) as err:
        preparer.prepare(request, {})
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and field in str(err.value)
