"""Our paged forward against transformers on tiny random models, fp32 (the K/V cache too:
a 16-bit cache, the default under fp32 activations, is held to its own rounding below)."""

import copy

import torch

from specd.models.loader import load_model
from specd.models.paged_kv import PagedKV
from specd.models.seq_input import SeqInput
from tests.conftest import TEST_DEVICE

TOL = 1e-4


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().to(TEST_DEVICE)  # [len, V]


def setup(tiny, num_blocks=64, block_size=4, kv="fp32"):
    folder, hf = tiny
    model = load_model(folder, dtype="fp32", device=TEST_DEVICE, kv=kv)
    kv = PagedKV.for_model(model, num_blocks=num_blocks, block_size=block_size)
    return model, kv, hf


def test_prefill_then_decode(tiny):
    model, kv, hf = setup(tiny)
    ids = [5, 17, 33, 2, 90, 41, 7, 8, 11]
    kv.allocator.allocate("a")
    got = model.forward(kv, [SeqInput("a", ids[:6], num_logits=6)])
    assert (got - hf_logits(hf, ids[:6])).abs().max() <= TOL
    for n in range(6, len(ids)):
        got = model.forward(kv, [SeqInput("a", [ids[n]])])
        ref = hf_logits(hf, ids[: n + 1])[-1:]
        assert (got - ref).abs().max() <= TOL


def test_a_16bit_cache_is_the_default_under_fp32_and_stays_within_its_rounding(tiny):
    """fp16 keys and values (llama.cpp's default cache type) under fp32 activations: the
    pools are half the bytes, and the logits move by the cache's rounding only."""
    model, kv, hf = setup(tiny, kv="auto")
    assert model.kv_dtype == torch.float16 and kv.k[0].dtype == torch.float16
    assert PagedKV.bytes_per_block(model, 4) == kv.k[0][:4].nbytes * 2 * len(kv.k)  # K and V
    ids = [5, 17, 33, 2, 90, 41, 7, 8, 11]
    kv.allocator.allocate("a")
    errors = [(model.forward(kv, [SeqInput("a", ids[:6], 6)]) - hf_logits(hf, ids[:6])).abs()]
    for n in range(6, len(ids)):
        got = model.forward(kv, [SeqInput("a", [ids[n]])])
        errors.append((got - hf_logits(hf, ids[: n + 1])[-1:]).abs())
    worst = max(float(e.max()) for e in errors)
    assert 0 < worst <= 2e-2  # fp16 rounds each key/value by <= 2^-11 relative


def test_mixed_batch_and_truncate(tiny):
    model, kv, hf = setup(tiny)
    g = torch.Generator().manual_seed(1)
    a_ids = torch.randint(3, 96, (7,), generator=g).tolist()
    b_ids = torch.randint(3, 96, (6,), generator=g).tolist()  # 5 cached + decode 1
    c_ids = torch.randint(3, 96, (10,), generator=g).tolist()  # 6 cached + append 4
    for s in "abc":
        kv.allocator.allocate(s)
    model.forward(kv, [SeqInput("b", b_ids[:5], 0), SeqInput("c", c_ids[:6], 0)])

    got = model.forward(
        kv, [SeqInput("a", a_ids, 7), SeqInput("b", b_ids[5:], 1), SeqInput("c", c_ids[6:], 4)]
    )
    ref = torch.cat([hf_logits(hf, a_ids), hf_logits(hf, b_ids)[-1:], hf_logits(hf, c_ids)[-4:]])
    assert got.shape == ref.shape
    assert (got - ref).abs().max() <= TOL

    # reject the last 3 of c's appended tokens and of a's prompt, then continue differently
    kv.allocator.truncate_to("c", 7)
    kv.allocator.truncate_to("a", 4)
    c2 = c_ids[:7] + [3, 4]
    a2 = a_ids[:4] + [60]
    got = model.forward(
        kv, [SeqInput("c", c2[7:], 2), SeqInput("a", a2[4:], 1), SeqInput("b", [9], 1)]
    )
    ref = torch.cat(
        [hf_logits(hf, c2)[-2:], hf_logits(hf, a2)[-1:], hf_logits(hf, b_ids + [9])[-1:]]
    )
    assert (got - ref).abs().max() <= TOL
    for s in "abc":
        kv.allocator.free(s)
    assert kv.allocator.num_used == 0


def test_rope_rows_come_from_a_table_that_holds_what_each_step_would_compute(tiny):
    """cos and sin come from a table by position, built again twice as long when a step
    passes it; every row is bit for bit what computing that step's positions gives (both
    dtypes), and a step past the table grows it."""
    for dtype in ("fp32", "bf16"):
        model = load_model(tiny[0], dtype=dtype, device=TEST_DEVICE)
        g = torch.Generator().manual_seed(0)
        sizes = []
        for end in (5, 90, 700, 3000):
            positions = torch.randint(0, end, (int(torch.randint(1, 20, (1,), generator=g)),))
            positions[0] = end - 1
            positions = positions.to(TEST_DEVICE)
            cos, sin = model._rope(positions, end)
            want_cos, want_sin = model._rope_rows(positions)
            assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
            sizes.append(model._rope_table[0].shape[0])
        assert sizes[0] == sizes[1] < sizes[2] < sizes[3] and sizes[3] >= 3000


def test_a_16bit_checkpoint_under_fp32_keeps_its_matrices_16bit(tiny, cpu_kernels, tmp_path):
    """fp32 activations over a bf16 checkpoint on a CPU with the kernels: the matrices stay
    bf16 in memory (half the bytes), norms and biases fp32, and the logits are those of
    transformers in fp32 over the same bf16 weights, in prefill (70 rows: the widened
    slabs) and decode (the native kernel)."""
    folder, hf = tiny
    copy.deepcopy(hf).to(torch.bfloat16).save_pretrained(tmp_path)
    ref = copy.deepcopy(hf)  # the bf16 weights, exactly, in fp32 (its rope tables fp32)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(p.bfloat16().float())
    model = load_model(tmp_path, dtype="fp32", device="cpu", kv="fp32")
    layer = model.layers[0]
    for w in (model.embed, model.lm_head, layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down):
        assert w.dtype == torch.bfloat16
    assert layer.attn_norm.dtype == model.norm.dtype == torch.float32
    assert layer.bqkv is None or layer.bqkv.dtype == torch.float32
    kv = PagedKV.for_model(model, num_blocks=64, block_size=4)
    ids = torch.randint(3, 96, (73,), generator=torch.Generator().manual_seed(2)).tolist()
    kv.allocator.allocate("a")
    got = model.forward(kv, [SeqInput("a", ids[:70], num_logits=70)])
    assert (got - hf_logits(ref, ids[:70]).cpu()).abs().max() <= TOL
    for n in range(70, len(ids)):
        got = model.forward(kv, [SeqInput("a", [ids[n]])])
        assert (got - hf_logits(ref, ids[: n + 1]).cpu()[-1:]).abs().max() <= TOL
