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
