"""The router's streaming detokenizer and stop strings, on a byte-level tokenizer whose
tokens are single bytes, so most non-ASCII characters are split across tokens."""

from __future__ import annotations

import random

import pytest

from router.detok import IncrementalDetokenizer, StopStrings

TEXTS = ["plain ascii", "café au lait", "naïve 日本語 text", "emoji 🚀🎉 and more", "Ω≈ç√∫"]


@pytest.fixture(scope="module")
def byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def _stream(tokenizer, ids: list[int], chunks: list[int]) -> list[str]:
    detok, deltas, at = IncrementalDetokenizer(tokenizer), [], 0
    for n in chunks:
        deltas.append(detok.push(ids[at : at + n]))
        at += n
    return deltas


def test_a_split_character_is_released_whole_once_its_last_byte_arrives(byte_tokenizer):
    ids = byte_tokenizer.encode("é", add_special_tokens=False)
    assert len(ids) == 2  # two bytes, two tokens
    assert _stream(byte_tokenizer, ids, [1, 1]) == ["", "é"]


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_join_to_the_text_in_any_chunking(byte_tokenizer, text):
    ids = byte_tokenizer.encode(text, add_special_tokens=False)
    rng = random.Random(text)
    for _ in range(5):
        chunks, left = [], len(ids)
        while left:
            chunks.append(min(left, rng.randint(1, 4)))
            left -= chunks[-1]
        deltas = _stream(byte_tokenizer, ids, chunks)
        assert "".join(deltas) == text
        assert not any("\ufffd" in d for d in deltas)


def test_stop_strings_cut_exactly_even_across_deltas():
    stops = StopStrings(["</end>", "STOP"])
    released = [stops.feed(d) for d in ["hello </e", "nd> never sent"]]
    assert "".join(released) == "hello " and stops.stopped
    assert stops.feed("more") == "" and stops.flush() == ""


def test_text_that_only_starts_like_a_stop_is_held_then_released():
    stops = StopStrings(["STOP"])
    assert stops.feed("go ST") == "go"  # the last len("STOP") - 1 chars may begin one
    assert stops.feed("ay") == " S"
    assert stops.flush() == "Tay" and not stops.stopped


def test_without_stop_strings_everything_passes_at_once():
    stops = StopStrings(["", ""])
    assert stops.feed("abc") == "abc" and stops.flush() == ""


def test_the_earliest_stop_wins_and_is_named_and_kept_where_asked():
    for include, text in [(False, "a "), (True, "a STOP")]:
        stops = StopStrings(["</end>", "STOP"], include=include)
        released = stops.feed("a STOP b </end>") + stops.flush()
        assert released == text and stops.matched == "STOP"


def test_text_fed_before_min_tokens_is_never_cut_but_a_stop_reaching_past_it_is():
    stops = StopStrings(["STOP"])
    assert stops.feed("a STOP b ST", search=False) == "a STOP b"  # exempt, tail held
    assert not stops.stopped
    assert stops.feed("OP c") + stops.flush() == " " and stops.matched == "STOP"
    exempt = StopStrings(["STOP"])
    released = exempt.feed("a STOP", search=False) + exempt.feed(" b") + exempt.flush()
    assert released == "a STOP b" and not exempt.stopped
