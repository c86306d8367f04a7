"""llama.cpp's infill sampler (specd/infill_filter.py) and llama.cpp's sampler order
(SamplingParams.temperature_last), on hand-made rows."""

import math

import pytest
import torch

from specd.infill_filter import InfillFilter
from specd.logits import logits_to_probs
from specd.params import SamplingParams

# token id -> its text; 0 and 1 end the generation (special: no text)
PIECES = [b"", b"", b"def", b"de", b"d", b"x", b"return", b"ret", b"  ", b"pass", b"y", b"z"]
EOG = {0, 1}


def row(probs: dict[int, float]) -> torch.Tensor:
    out = torch.zeros(1, len(PIECES))
    for token, p in probs.items():
        out[0, token] = p
    return out / out.sum()


def kept(probs: dict[int, float]) -> set[int]:
    keep = InfillFilter(PIECES, EOG, end=0).keep(row(probs))
    return set(keep[0].nonzero()[:, 0].tolist())


def test_likely_enough_end_leaves_only_the_end_tokens():
    # 3 * e * n > t: e = 0.05, n = 4, t = 0.95 -> 0.6 <= 0.95 stays text
    assert kept({0: 0.05, 2: 0.5, 5: 0.3, 9: 0.15}) == {0, 2, 5}
    # e = 0.1, n = 4: 1.2 > 0.9 -> the end-of-generation tokens alone
    assert kept({0: 0.06, 1: 0.04, 2: 0.5, 5: 0.4}) == {0, 1}


def test_a_token_that_begins_another_is_merged_into_the_likelier():
    # "d" (0.15) begins "de" (0.18) and "def" (0.16), none of them 0.2: walking the
    # likeliest first, "de" takes "def" (0.34), then "d" (0.49); "x" (0.30) and "pass"
    # (0.21) pass 0.2 on their own, but over the three that stayed "pass" is below 1/4
    assert kept({2: 0.16, 3: 0.18, 4: 0.15, 5: 0.30, 9: 0.21}) == {3, 5}
    # "ret" (0.17) joins "return" (0.18): 0.35 stays, and 0.41 of the two left is >= 1/3
    assert kept({6: 0.18, 7: 0.17, 5: 0.50, 9: 0.15}) == {6, 5}


def test_no_text_token_left_keeps_the_end_token_alone():
    # every text token below 0.2 and unmergeable (the end token 1 too unlikely to end it):
    # the end token 0, though it had no mass
    assert kept({5: 0.198, 8: 0.198, 9: 0.198, 6: 0.198, 2: 0.198, 1: 0.01}) == {0}


def test_the_drawn_row_is_the_softmax_over_the_kept_tokens():
    """llama.cpp's last step draws from the kept tokens' own logits: merged mass decides
    who stays, not how likely it is."""
    logits = torch.log(row({2: 0.16, 3: 0.18, 4: 0.15, 5: 0.30, 9: 0.21}))
    params = SamplingParams(temperature=0.5, top_k=8, infill=True, temperature_last=True)
    probs = logits_to_probs(logits, params, infill=InfillFilter(PIECES, EOG, end=0))
    tempered = {t: math.exp(math.log(p) / 0.5) for t, p in {3: 0.18, 5: 0.30}.items()}
    total = sum(tempered.values())
    for token in range(len(PIECES)):
        assert probs[0, token].item() == pytest.approx(tempered.get(token, 0.0) / total, rel=1e-5)
    # the end token with no probability of its own is drawn for certain
    logits = torch.full((1, len(PIECES)), -30.0)
    logits[0, [2, 5, 6, 8, 9, 10, 11]] = 0.0  # seven at 1/7 each
    logits[0, 1] = -200.0  # no candidate, and no probability at all once tempered
    end_only = logits_to_probs(logits, params, infill=InfillFilter(PIECES, EOG, end=1))
    assert end_only[0].tolist() == [0.0, 1.0] + [0.0] * (len(PIECES) - 2)


def test_temperature_last_truncates_the_untempered_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    first = SamplingParams(temperature=2.0, top_p=0.75)
    last = SamplingParams(temperature=2.0, top_p=0.75, temperature_last=True)
    # at T = 2 the mass before the third token is 0.67 < 0.75: three tokens stay
    assert (logits_to_probs(logits, first) > 0).sum().item() == 3
    # untempered it is 0.8: two stay, then tempered between themselves
    p = logits_to_probs(logits, last)
    a, b = math.sqrt(0.5), math.sqrt(0.3)
    assert p[0].tolist() == pytest.approx([a / (a + b), b / (a + b), 0, 0], rel=1e-5)
    greedy = SamplingParams(temperature=0.0, top_p=0.75, temperature_last=True)
    assert logits_to_probs(logits, greedy)[0].tolist() == [1, 0, 0, 0]


def test_the_infill_sampler_needs_candidates_and_a_temperature():
    with pytest.raises(ValueError, match="infill"):
        SamplingParams(temperature=0.0, top_k=40, infill=True).validate()
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(temperature=1.0, infill=True).validate()
    SamplingParams(temperature=1.0, top_k=40, infill=True).validate()
