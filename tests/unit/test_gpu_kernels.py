"""The GPU step's Triton kernels (specd.models.gpu), on a CPU under Triton's interpreter
(on a GPU, `make test-cuda` runs the same tests compiled): attention read in place from
the paged pool against the fp64 reference of the CPU kernel's row semantics (chains,
trees up to 64 nodes, GQA, several key splits, padding rows), every row the same bits
alone and in a batch; the element-wise ops against specd.models.layer_ops' torch code."""

import pytest
import torch

from specd.models import attention, layer_ops
from specd.models.attention import PagedRows
from specd.models.seq_input import SeqInput

BS = 4
# compiled on a GPU; under Triton's interpreter on a CPU (tests/conftest.py)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def on(*tensors):
    return [t.to(DEVICE) for t in tensors]


def rows_of(rows: PagedRows) -> dict:
    """The GPU kernel's per-row fields for a PagedRows: each row's sequence and end."""
    counts = rows.seq_rows.diff()
    row_seq = torch.repeat_interleave(torch.arange(len(counts)), counts)
    bits = torch.tensor([(int(t) % (1 << 64)).bit_length() for t in rows.tree])
    return dict(table=rows.table, row_seq=row_seq, limit=rows.limit, end=rows.limit + bits)


def pools(blocks, kv_heads, dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(blocks * BS, kv_heads, dim, generator=g).to(dtype)
    v = torch.randn(blocks * BS, kv_heads, dim, generator=g).to(dtype)
    return k, v


def attend(triton_attention, q, k, v, rows: PagedRows, split_keys: int):
    f = rows_of(rows)
    args = on(q, k, v, f["table"], f["row_seq"], f["limit"], f["end"], rows.tree)
    return triton_attention.paged_attention(*args, BS, split_keys).cpu()


def wide_tree(n: int, seed: int = 5) -> SeqInput:
    g = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(-1, i, (1,), generator=g)) for i in range(1, n)]
    return SeqInput(0, [1] * n, n, parents=parents)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dtype", "split_keys"),
    [(4, 2, torch.float32, 16), (6, 2, torch.bfloat16, 256), (4, 4, torch.float16, 40)],
)
def test_attention_matches_the_reference(triton_ops, split_keys, heads, kv_heads, dtype):
    triton_attention, _ = triton_ops
    dim = 16
    k, v = pools(60, kv_heads, dim, dtype)
    tree = wide_tree(64)  # its last rows see through bit 63
    table = torch.randperm(60, generator=torch.Generator().manual_seed(1)).view(2, 30)
    # a 64-node tree after 30 cached keys; a 3-token chain after 97 (a prefill chunk)
    spans = [(30, 94), (97, 100)]
    rows = PagedRows.build(table, BS, spans, [tree.ancestry(), None])
    assert int(rows.tree[63]) < 0  # bit 63 set: the sign bit of the int64
    q = torch.randn(67, heads, dim, generator=torch.Generator().manual_seed(2)).to(dtype)
    got = attend(triton_attention, q, k, v, rows, split_keys)
    want = attention.reference(q, k, v, rows)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # 16 bits: the output's rounding
    assert (got.float() - want.float()).abs().max() < tol


def test_a_long_row_has_more_splits_than_programs(triton_ops):
    triton_attention, _ = triton_ops
    split_keys = 4
    keys = 3 * triton_attention.PARTS * split_keys  # each program takes three splits
    k, v = pools(keys // BS, 1, 16, torch.float32)
    table = torch.randperm(keys // BS, generator=torch.Generator().manual_seed(6)).view(1, -1)
    rows = PagedRows.build(table, BS, [(keys - 3, keys)], [None])  # a 3-row verification
    q = torch.randn(3, 2, 16, generator=torch.Generator().manual_seed(7))
    got = attend(triton_attention, q, k, v, rows, split_keys)
    assert (got - attention.reference(q, k, v, rows)).abs().max() < 1e-5


def test_a_padding_row_reads_no_key_and_gives_zeros(triton_ops):
    triton_attention, _ = triton_ops
    k, v = pools(8, 2, 16, torch.float32)
    q = torch.randn(3, 4, 16)
    table = torch.arange(8).view(1, 8)
    zeros = torch.zeros(3, dtype=torch.long)
    limit = torch.tensor([5, 0, 0])
    end = torch.tensor([5, 0, 0])  # rows 1 and 2 are padding
    args = on(q, k, v, table, zeros, limit, end, zeros)
    out = triton_attention.paged_attention(*args, BS, 8).cpu()
    assert out[1:].abs().max() == 0
    ref = attention.reference(q[:1], k, v, PagedRows.build(table, BS, [(4, 5)], [None]))
    assert (out[:1] - ref).abs().max() < 1e-5


def test_a_row_is_the_same_bits_alone_and_in_a_batch(triton_ops):
    triton_attention, _ = triton_ops
    k, v = pools(40, 2, 16, torch.float32)
    table = torch.randperm(40, generator=torch.Generator().manual_seed(3)).view(4, 10)
    q = torch.randn(12, 4, 16, generator=torch.Generator().manual_seed(4))
    # sequence 2's decode row, alone and then beside a verification and a prefill chunk
    alone = PagedRows.build(table[2:3], BS, [(33, 34)], [None])
    batch = PagedRows.build(table[:3], BS, [(20, 25), (0, 6), (33, 34)], [None] * 3)
    a = attend(triton_attention, q[11:12], k, v, alone, 16)
    b = attend(triton_attention, q[:12], k, v, batch, 16)
    assert torch.equal(a[0], b[11])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_ops_match_the_torch_code(triton_ops, dtype):
    _, ops = triton_ops
    g = torch.Generator().manual_seed(0)
    rows, hidden, heads, kv_heads, dim = 5, 64, 4, 2, 16
    ulp = 0.0 if dtype == torch.float32 else 2.0**-7  # the interpreter truncates to bf16

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(DEVICE, dtype)

    def close(a, b, scale=1.0):
        return (a.float() - b.float()).abs().max() <= 1e-5 + 2 * ulp * scale

    x, res, w = rand(rows, hidden), rand(rows, hidden), rand(hidden)
    want_x, want_y = layer_ops.add_rms_norm(x, res, w, 1e-6, False)
    got_x = x.clone()
    got_y = ops.add_rms_norm(got_x, res, w, 1e-6, rows)
    assert close(got_x, want_x, 4) and close(got_y, want_y, 8)

    qkv = rand(rows, (heads + 2 * kv_heads) * dim)
    bias = rand(qkv.shape[1])
    positions, slots = on(torch.tensor([3, 9, 0, 4, 7]), torch.tensor([5, 2, -1, 7, 0]))
    freqs = torch.arange(16)[:, None].float() / 10000 ** (torch.arange(0, dim, 2) / dim)
    emb = torch.cat([freqs, freqs], -1).to(DEVICE)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    k_want = torch.zeros(8, kv_heads, dim, dtype=dtype, device=DEVICE)
    v_want, k_got, v_got = k_want.clone(), k_want.clone(), k_want.clone()
    keep = slots >= 0  # row 2 writes nothing
    want_q = layer_ops.rope_store(
        qkv[keep] + bias, cos[positions[keep]], sin[positions[keep]], k_want, v_want,
        slots[keep], heads, kv_heads, False,
    )  # fmt: skip
    got_q = ops.rope_store(
        qkv, bias, cos, sin, positions, slots, k_got, v_got, heads, kv_heads, rows
    )
    assert close(got_q[keep], want_q, 4) and close(k_got, k_want, 4) and close(v_got, v_want, 4)
    assert k_got[[1, 3, 4, 6]].abs().max() == 0  # slots no row wrote

    gate_up = rand(rows, 2 * 96)
    assert close(ops.silu_mul(gate_up, rows), layer_ops.silu_mul(gate_up, False), 4)


def test_layer_ops_leave_the_padding_rows_alone(triton_ops):
    _, ops = triton_ops
    x = torch.randn(6, 32, device=DEVICE)
    before = x.clone()
    y = torch.full((6, 32), 7.0, device=DEVICE)
    ops.add_rms_norm(
        x, torch.ones(6, 32, device=DEVICE), torch.ones(32, device=DEVICE), 1e-6, 2, out=y
    )
    assert torch.equal(x[2:], before[2:]) and not torch.equal(x[:2], before[:2])
    assert (y[2:] == 7.0).all()
