"""Batch-invariant mode on the real target's dense weights: a token's logits are bitwise
the same whether it is decoded alone or verified inside a (k+1)-token forward, in bf16
(16-row tiles) and in fp32 with an fp16 K/V cache (the dense fp32 kernel)."""

import dataclasses

import pytest
import torch

from specd.models.catalog import DEFAULT_TARGET
from specd.models.loader import load_model
from specd.models.paged_kv import PagedKV
from specd.models.seq_input import SeqInput
from tests.conftest import real_model_or_skip


@pytest.mark.real
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_decode_and_verification_agree_bitwise(request, dtype):
    if dtype == "fp32":
        request.getfixturevalue("cpu_kernels")  # fp32's invariant matmul is native
    model = load_model(real_model_or_skip(DEFAULT_TARGET), dtype=dtype, device="cpu")
    assert model.kv_dtype == (torch.float16 if dtype == "fp32" else torch.bfloat16)
    # Its first 4 of 28 layers, and the head: the layers have one shape and run one code
    # path, so a row that rounds differently beside others does so in the first, and the
    # residual stream carries that to the logits. A forward of all 28 costs ~6 s in 16-row
    # bf16 tiles on a CPU without bf16 hardware.
    model.layers = model.layers[:4]
    model.args = dataclasses.replace(model.args, num_layers=len(model.layers))
    g = torch.Generator().manual_seed(0)
    # the 5 tokens below cross 512 keys: 5 decodes and one verification of 5
    context = 509
    tokens = torch.randint(100, 20000, (5,), generator=g).tolist()

    # The context both paths attend to: random K/V in place of a 509-token prefill (which
    # costs ~100 s in bf16 on an AVX2 CPU); what is compared is how the two paths read it.
    kv = PagedKV.for_model(model, num_blocks=40)
    kv.allocator.allocate(0)
    kv.allocator.append(0, context)
    for pool in (*kv.k, *kv.v):
        pool.copy_(torch.randn(pool.shape, generator=g) * 2)
    cached = [pool.clone() for pool in (*kv.k, *kv.v)]

    def run(chunk: int) -> torch.Tensor:
        kv.allocator.truncate_to(0, context)
        for pool, saved in zip((*kv.k, *kv.v), cached, strict=True):
            pool.copy_(saved)
        model.batch_invariant = True
        try:
            rows = [
                model.forward(kv, [SeqInput(0, tokens[i : i + chunk], chunk)])
                for i in range(0, len(tokens), chunk)
            ]
        finally:
            model.batch_invariant = False
        return torch.cat(rows)

    decoded, verified = run(1), run(5)
    assert torch.equal(decoded, verified), float((decoded - verified).abs().max())
