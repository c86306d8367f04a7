"""Attention read in place from the paged pool (kernels/paged_attention.cpp): the kernel
against a slow fp64 reference on scattered block tables, chains and trees; batch
invariance (a row's bits are the same alone, in a k+1-row verification and beside other
sequences); and the model's forward on it against the SDPA path."""

import pytest
import torch

from specd.models import attention
from specd.models.attention import PagedRows
from specd.models.paged_kv import PagedKV
from specd.models.seq_input import SeqInput

H, HKV, D, BS = 6, 2, 32, 16


@pytest.fixture
def kernel(cpu_kernels):
    return cpu_kernels


def pools(dtype, blocks=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(blocks * BS, HKV, D, generator=g).to(dtype)
    v = torch.randn(blocks * BS, HKV, D, generator=g).to(dtype)
    return k, v


def tables(n_seqs, width, seed=1):
    """Each sequence gets `width` distinct, shuffled blocks."""
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(n_seqs * width, generator=g).view(n_seqs, width)


def queries(rows, dtype, seed=2):
    return torch.randn(rows, H, D, generator=torch.Generator().manual_seed(seed)).to(dtype)


# (queries, K/V pools): one dtype, or a 16-bit cache read under fp32 activations
@pytest.mark.parametrize(
    ("dtype", "pool_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float16),
        (torch.float32, torch.bfloat16),
    ],
)
def test_chains_and_trees_match_the_reference(kernel, dtype, pool_dtype):
    k, v = pools(pool_dtype)
    tree = SeqInput(0, [1] * 6, 6, parents=[-1, 0, 0, 1, 3, -1])
    # three sequences: a 7-token chain after 90 cached, one decode token, a 6-node tree
    spans = [(90, 97), (40, 41), (70, 76)]
    rows = PagedRows.build(tables(3, 8), BS, spans, [None, None, tree.ancestry()])
    q = queries(14, dtype)
    got = attention.paged_attention(q, k, v, rows)
    want = attention.reference(q, k, v, rows)
    tol = 1e-5 if dtype == torch.float32 else 8e-3  # bf16: one rounding of the output
    assert (got.float() - want.float()).abs().max() < tol


def test_tree_rows_see_only_their_ancestors(kernel):
    """A tree node's output must not move when a sibling's key changes."""
    k, v = pools(torch.float32)
    tree = SeqInput(0, [1] * 3, 3, parents=[-1, -1, 1])  # nodes 0 and 1 are siblings
    rows = PagedRows.build(tables(1, 8), BS, [(20, 23)], [tree.ancestry()])
    q = queries(3, torch.float32)
    before = attention.paged_attention(q, k, v, rows)
    slot_of_node0 = int(rows.table[0, 20 // BS]) * BS + 20 % BS
    k[slot_of_node0] += 5.0
    v[slot_of_node0] -= 3.0
    after = attention.paged_attention(q, k, v, rows)
    assert not torch.equal(before[0], after[0])
    assert torch.equal(before[1:], after[1:])


# every pool a default can pick: the activations' dtype, and fp16 under fp32 activations
@pytest.mark.parametrize(
    ("dtype", "pool_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float16),
    ],
    ids=["fp32", "bf16", "fp32-fp16pool"],
)
def test_a_row_is_the_same_alone_in_a_verification_and_in_a_batch(kernel, dtype, pool_dtype):
    k, v = pools(pool_dtype)
    table = tables(3, 8)
    q = queries(8, dtype)
    # verification: 7 new tokens after 60 cached; row 3 sees keys 0..63
    verify = PagedRows.build(table[:1], BS, [(60, 67)], [None])
    in_verify = attention.paged_attention(q[:7], k, v, verify)[3]
    # the same row as a decode step of its own (64 keys), alone and beside two others
    alone = PagedRows.build(table[:1], BS, [(63, 64)], [None])
    got_alone = attention.paged_attention(q[3:4], k, v, alone)[0]
    batch = PagedRows.build(table[[1, 0, 2]], BS, [(10, 12), (63, 64), (99, 103)], [None] * 3)
    q_batch = torch.cat([q[:2], q[3:4], q[4:8]])
    got_batch = attention.paged_attention(q_batch, k, v, batch)[2]
    assert torch.equal(in_verify, got_alone)
    assert torch.equal(got_alone, got_batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_long_prefill_chunk_split_into_tiles_is_each_row_alone(kernel, dtype):
    """200 rows over ~1,000 keys hold 2.4 MB of scores: the kernel splits them into tiles
    of rows (kernels/paged_attention.cpp, SCORE_BYTES). Every row comes out as the
    reference says and bit for bit as computed alone, and so does the chunk cut in two."""
    k, v = pools(dtype, blocks=64)
    table = tables(1, 64)
    q = queries(200, dtype)
    chunk = PagedRows.build(table, BS, [(820, 1020)], [None])
    got = attention.paged_attention(q, k, v, chunk)
    want = attention.reference(q, k, v, chunk)
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    assert (got.float() - want.float()).abs().max() < tol
    for r in (0, 17, 99, 100, 163, 199):
        alone = PagedRows.build(table, BS, [(820 + r, 821 + r)], [None])
        assert torch.equal(attention.paged_attention(q[r : r + 1], k, v, alone)[0], got[r])
    halves = [
        PagedRows.build(table, BS, [(820 + a, 820 + b)], [None]) for a, b in ((0, 77), (77, 200))
    ]
    cut = torch.cat([attention.paged_attention(q[:77], k, v, halves[0]),
                     attention.paged_attention(q[77:], k, v, halves[1])])  # fmt: skip
    assert torch.equal(cut, got)


def test_the_reference_is_not_fooled_by_a_wrong_mask(kernel):
    """The comparison above can fail: a chain whose rows see one key too many differs."""
    k, v = pools(torch.float32)
    rows = PagedRows.build(tables(1, 8), BS, [(30, 34)], [None])
    wrong = PagedRows(rows.table, BS, rows.seq_rows, rows.limit + 1, rows.tree)
    q = queries(4, torch.float32)
    got = attention.paged_attention(q, k, v, rows)
    assert (got - attention.reference(q, k, v, wrong)).abs().max() > 1e-3


def test_the_model_forward_matches_the_sdpa_path(kernel, tiny_pair, monkeypatch):
    target, _ = tiny_pair
    prompt = [3, 14, 15, 9, 26, 5, 35, 8, 9, 7, 9, 3, 2, 38, 4, 6, 26, 4, 33, 8]
    steps = [[1], [7, 3, 2, 8], [5]]

    def run(paged: bool):
        target._paged = paged
        kv = PagedKV.for_model(target, num_blocks=8)
        kv.allocator.allocate(0)
        out = [target.forward(kv, [SeqInput(0, prompt[:17], 1)])]
        out += [target.forward(kv, [SeqInput(0, prompt[17:], 1)])]  # 3 rows: paged
        for s in steps:
            out.append(target.forward(kv, [SeqInput(0, s, len(s))]))
        return torch.cat(out)

    try:
        paged, sdpa = run(True), run(False)
    finally:
        target._paged = None
    assert (paged - sdpa).abs().max() < 1e-4


def test_pools_of_another_dtype_are_refused_unless_16_bit_under_fp32(kernel):
    rows = PagedRows.build(tables(1, 8), BS, [(10, 11)], [None])
    k, v = pools(torch.float16)
    with pytest.raises(
        RuntimeError, match="pools must have the activations' dtype, or be fp16 / bf16"
    ):
        attention.paged_attention(queries(1, torch.bfloat16), k, v, rows)
    with pytest.raises(RuntimeError, match="the K and V pools must have one dtype"):
        attention.paged_attention(queries(1, torch.float32), k, v.float(), rows)
