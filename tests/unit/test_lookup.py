"""The lookup's index answers as the scan it replaces, as a sequence grows, for states
drafted ahead, for another sequence's tokens and through hash collisions; and it is
dropped with its sequence."""

import random

import pytest

from drafter_service.combined import CombinedProposer
from drafter_service.suffix import SuffixProposer
from specd.lookup import NgramIndex, NgramProposer, ngram_propose
from specd.proposal import DraftState, Proposal


def _grown(rng: random.Random, size: int, alphabet: int) -> list[int]:
    """A text that repeats itself in places, as code does."""
    tokens = []
    while len(tokens) < size:
        if tokens and rng.random() < 0.4:
            start = rng.randrange(len(tokens))
            tokens += tokens[start : start + rng.randint(1, 12)]
        else:
            tokens.append(rng.randrange(alphabet))
    return tokens[:size]


@pytest.mark.parametrize("window", [(4, 1), (8, 3), (3, 3)])
@pytest.mark.parametrize("alphabet", [3, 50])
def test_index_answers_as_the_scan_while_a_sequence_commits(window, alphabet):
    max_n, min_n = window
    rng = random.Random(alphabet * 10 + max_n)
    for _ in range(4):
        tokens = _grown(rng, 300, alphabet)
        index, size = NgramIndex(max_n, min_n), 1
        while size < len(tokens):
            committed = tokens[:size]
            k = rng.randint(0, 6)
            assert index.follow(committed, k) == ngram_propose(committed, k, max_n, min_n)
            # a state drafted ahead: tokens past the committed ones, scanned, not indexed
            ahead = committed + tokens[size : size + rng.randint(1, 5)]
            if rng.random() < 0.5:  # a guess the target did not take
                ahead = committed + [rng.randrange(alphabet) for _ in range(3)]
            assert index.follow(ahead, k, commit=False) == ngram_propose(ahead, k, max_n, min_n)
            size += rng.randint(1, 6)


def test_tokens_never_committed_stay_out_of_the_index():
    index = NgramIndex(4, 1)
    committed = [1, 2, 3, 4, 5, 6, 1, 2]
    assert index.follow(committed, 3) == [3, 4, 5] and index.covered == 8
    guess = committed + [3, 9, 9]  # drafted ahead: the target may not take it
    assert index.follow(guess, 3, commit=False) == ngram_propose(guess, 3) == [9]
    assert index.covered == 8
    actual = committed + [3, 4]
    assert index.follow(actual, 3) == ngram_propose(actual, 3) == [5, 6, 1]
    assert index.covered == 10


def test_tokens_of_another_sequence_start_the_index_over():
    index = NgramIndex(4, 1)
    index.follow([5, 6, 7, 5, 6], 2)
    other = [9, 8, 9, 8]
    assert index.follow(other, 2) == ngram_propose(other, 2) == [9, 8]
    shorter = [5, 6, 5]
    assert index.follow(shorter, 2) == ngram_propose(shorter, 2) == [6, 5]


def test_a_hash_two_ngrams_share_is_checked_against_the_tokens(monkeypatch):
    """Every n-gram hashed alike: each read of the index finds another's end, and the
    answers are still the scan's."""
    monkeypatch.setattr("specd.lookup.hash", lambda key: 0, raising=False)
    rng = random.Random(3)
    tokens = _grown(rng, 200, 5)
    index = NgramIndex(4, 1)
    for size in range(1, len(tokens), 3):
        assert index.follow(tokens[:size], 4) == ngram_propose(tokens[:size], 4)


class NoModel:
    """A draft model that drafts nothing (the lookups are what is tested)."""

    def propose(self, states):
        return [Proposal() for _ in states]

    def close(self, seq_id):
        pass


def _state(seq_id, tokens, k=3):
    return DraftState(seq_id, tokens, None, k)


@pytest.mark.parametrize(
    "make",
    [NgramProposer, lambda: CombinedProposer(NoModel()), lambda: SuffixProposer(shared=False)],
    ids=["ngram", "combined", "suffix"],
)
def test_a_closed_sequence_leaves_no_index(make):
    proposer = make()
    tokens = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3]
    proposals = proposer.propose([_state(1, tokens), _state(2, tokens[:7])])
    assert proposals[0].tokens == [4, 1, 2]
    held = proposer.lookups if hasattr(proposer.lookups, "close") else proposer.lookups["suffix"]
    assert len(held) == 2
    proposer.close(1)
    proposer.close(2)
    assert len(held) == 0
