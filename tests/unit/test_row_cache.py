"""A quantised embedding's recent rows (specd.models.row_cache): lookups give the weight's
own rows bit for bit, whether cached, fresh or a prompt's, and the cache stays bounded."""

import pytest
import torch

from specd.models.qlinear import quantize
from specd.models.row_cache import SMALL, RowCache


@pytest.mark.parametrize("bits", [4, 6, 8])
def test_rows_are_the_weights_own_and_the_cache_is_bounded(bits):
    g = torch.Generator().manual_seed(bits)
    w = quantize(torch.randn(96, 64, generator=g), bits)
    dense = w.dequantize(torch.float32)
    cache = RowCache(w, torch.float32, capacity=8)
    lookups = [[3], [3, 40], [40, 40, 3], [95], list(range(SMALL + 4))]
    lookups += [[int(t)] for t in torch.randint(0, 96, (40,), generator=g)]
    for ids in lookups:
        got = cache(torch.tensor(ids))
        assert torch.equal(got, dense[ids]), ids
        assert len(cache._rows) <= 8
    # the least recently used row goes first
    for t in [1, 2, *range(10, 16), 1, 16]:  # 1 looked up again, then one row too many
        cache(torch.tensor([t]))
    assert 1 in cache._rows and 2 not in cache._rows


def test_a_prompts_rows_are_kept_so_its_tokens_decode_from_the_cache():
    w = quantize(torch.randn(96, 64, generator=torch.Generator().manual_seed(1)), 6)
    dense = w.dequantize(torch.float32)
    cache = RowCache(w, torch.float32, capacity=SMALL + 2)
    dequantised = []
    real = w.rows
    w.rows = lambda ids, dtype: dequantised.append(ids.tolist()) or real(ids, dtype)
    prompt = [7, *range(30, 30 + SMALL + 4), 7, 50]  # longer than the cache holds
    assert torch.equal(cache(torch.tensor(prompt)), dense[prompt])
    assert len(cache._rows) == SMALL + 2
    # decoding goes on from the prompt's last tokens: they answer without dequantising
    for ids in ([50], [7, 50], [30 + SMALL + 3]):
        assert torch.equal(cache(torch.tensor(ids)), dense[ids])
    assert dequantised == [prompt]
    assert torch.equal(cache(torch.tensor([30])), dense[[30]])  # the oldest went first
    assert dequantised[-1] == [30]
