"""Stop token ids and stop strings on the OpenAI door: where they end a choice's text,
its token ids, log-probabilities and usage, each the same with speculation on and off."""

from tests.cluster import TINY_MODEL_ID, char_tokenizer
from tests.integration.openai_api.door import completion, completion_text


def test_stop_token_ids_end_a_choice_without_their_text_and_min_tokens_holds_them_off(
    client, grpc_client
):
    """vLLM's stop_token_ids: the choice ends at the first, its id in token_ids and in
    stop_reason, its text left out (kept with include_stop_str_in_output); min_tokens
    bans it before that many tokens. Each the same with speculation on and off."""
    plain = completion_text(client, "off")
    char = plain[5]
    first, stop = plain.index(char), char_tokenizer()(char)["input_ids"][0]
    for include, text in [(False, plain[:first]), (True, plain[: first + 1])]:
        ask = {"stop_token_ids": [stop], "include_stop_str_in_output": include}
        off, on = completion(client, "off", **ask), completion(client, "on", **ask)
        assert off.text == text and on.text == text
        assert off.finish_reason == "stop" and off.model_extra["stop_reason"] == stop
        assert off.model_extra["token_ids"][-1] == stop
        assert len(off.model_extra["token_ids"]) == first + 1
    held = {"stop_token_ids": [stop], "min_tokens": first + 3}
    off = completion(client, "off", **held)
    assert completion(client, "on", **held).model_extra["token_ids"] == off.model_extra["token_ids"]
    ids = off.model_extra["token_ids"]
    assert len(ids) >= first + 3 and stop not in ids[:-1] and char not in off.text
    reply = grpc_client.generate(
        "abcabc", max_new_tokens=24, ignore_eos=True, stop_token_ids=[stop], speculation="on"
    )
    assert reply.WhichOneof("stop_reason") == "stop_token_id" and reply.stop_token_id == stop
    assert reply.text == plain[:first]


def test_stop_strings_wait_for_min_tokens_and_may_stay_in_the_text(client):
    """A stop string ending within the first min_tokens tokens' text does not stop the
    choice; one ending past them does (vLLM's min_tokens). include_stop_str_in_output
    keeps it; stop_reason names it."""
    plain = completion_text(client, "off")
    stop = plain[3:5]
    at = plain.index(stop)
    for extra, text in [
        ({}, plain[:at]),
        ({"include_stop_str_in_output": True}, plain[: at + 2]),
        ({"min_tokens": at + 1}, plain[:at]),  # the stop reaches past them
    ]:
        for speculation in ("off", "on"):
            choice = completion(client, speculation, stop=[stop], **extra)
            assert choice.text == text and choice.model_extra["stop_reason"] == stop, extra
    later = [i for i in range(at + 1, len(plain)) if plain.startswith(stop, i)]
    held = completion(client, "on", stop=[stop], min_tokens=at + 2)
    assert held.text == (plain[: later[0]] if later else plain)
    assert held.model_extra["stop_reason"] == (stop if later else None)


def test_a_stop_string_ends_the_tokens_where_it_ends_the_text_with_speculation_too(client):
    """The output's tokens end at the one that completes the stop string: a speculative
    round that accepted tokens past it gives the same token ids, log-probabilities and
    usage as decoding without speculation (only the text was cut before)."""
    plain = completion_text(client, "off")
    answers = {}
    for speculation in ("off", "on"):
        for at in range(2, 20, 3):  # stops that complete at several places in a round
            r = client.completions.create(
                model=TINY_MODEL_ID,
                prompt="abcabc",
                temperature=0,
                max_tokens=24,
                stop=[plain[at : at + 2]],
                logprobs=2,
                extra_body={
                    "ignore_eos": True,
                    "speculation": speculation,
                    "return_token_ids": True,
                },
            )
            choice = r.choices[0]
            assert (
                choice.finish_reason == "stop"
                and choice.text == plain[: plain.index(choice.model_extra["stop_reason"])]
            )
            answers[speculation, at] = (
                choice.model_extra["token_ids"],
                choice.logprobs.tokens,
                choice.logprobs.token_logprobs,
                r.usage.completion_tokens,
            )
    for at in range(2, 20, 3):
        off, on = answers["off", at], answers["on", at]
        assert on == off and off[3] == len(off[0]) == len(off[1]), at
