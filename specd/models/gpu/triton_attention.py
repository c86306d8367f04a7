"""Attention read in place from the paged K/V pool, in Triton, with the CPU kernel's row
semantics (specd.models.attention.PagedRows): row r of sequence `row_seq[r]` sees the keys
j < limit[r] and limit[r] + i for each bit i of tree[r] (chains, trees, prefill chunks).

Flash-decoding's split-K, with its splits a constant of the model rather than of the
batch. A row's keys are cut into splits of `split_keys` positions, dealt to `PARTS`
programs in turn (split s to program s mod PARTS); each program takes one query row, one
K/V head and its group of query heads (GQA: the group is padded to 16 rows so that
q K^T and P V are tensor-core dots) over its splits in order, and leaves one partial
result (running max, sum, output); a second kernel combines a row's PARTS partials. So
the programs, the scratch (rows x heads x PARTS x D floats) and the combine's registers
do not grow with the context, and a row's result comes from its own keys in a fixed
order: a row rounds the same alone, in a batch, in a graph or eagerly.

The dots take fp32 operands: under 16-bit activations as TF32, which holds a bf16 or fp16
value exactly (Triton's interpreter, which tests them on a CPU, has no 16-bit dot); under
fp32 ones in full precision.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from specd.models.gpu import FP_FUSION

BLOCK_N = 32  # keys per inner iteration
PARTS = 16  # programs (and partial results) a row and K/V head: see above
# a finite "minus infinity": exp(NEG - m) is 0 and NEG - NEG is 0, never NaN (a constexpr:
# the compiler reads no other global inside a kernel)
NEG = tl.constexpr(-1.0e30)


@triton.jit
def _split_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, row_seq_ptr, limit_ptr, end_ptr, tree_ptr,
    acc_ptr, ml_ptr, table_stride, block_size, split_keys, scale,
    HEADS: tl.constexpr, KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GP: tl.constexpr,
    D: tl.constexpr, BLOCK: tl.constexpr, DOT: tl.constexpr, PARTS: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    kvh = tl.program_id(1)
    first = tl.program_id(2)  # this program's splits: first, first + PARTS, ...
    end = tl.load(end_ptr + r)
    if first * split_keys < end:
        limit = tl.load(limit_ptr + r)
        tree = tl.load(tree_ptr + r)
        seq = tl.load(row_seq_ptr + r)
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        heads = kvh * GROUP + g
        live = g < GROUP
        at_q = (r * HEADS + heads)[:, None] * D + d[None, :]
        q = tl.load(q_ptr + at_q, mask=live[:, None], other=0.0)
        q = q.to(tl.float32)  # [GP, D]
        m = tl.full([GP], NEG, tl.float32)
        l = tl.zeros([GP], tl.float32)  # noqa: E741
        acc = tl.zeros([GP, D], tl.float32)
        for s in range(first, tl.cdiv(end, split_keys), PARTS):
            lo = s * split_keys
            hi = tl.minimum(lo + split_keys, end)
            for start in range(lo, hi, BLOCK):
                j = start + tl.arange(0, BLOCK)
                inside = j < hi
                at_block = table_ptr + seq * table_stride + j // block_size
                block = tl.load(at_block, mask=inside, other=0)
                slot = block * block_size + j % block_size
                at = (slot * KV_HEADS + kvh)[:, None] * D + d[None, :]
                k = tl.load(k_ptr + at, mask=inside[:, None], other=0.0).to(tl.float32)
                v = tl.load(v_ptr + at, mask=inside[:, None], other=0.0).to(tl.float32)
                off = j - limit  # a tree key's bit; keys below the limit are all seen
                bit = (tree >> tl.minimum(tl.maximum(off, 0), 63).to(tl.int64)) & 1
                seen = inside & ((off < 0) | ((off < 64) & (bit == 1)))
                scores = tl.dot(q, tl.trans(k), input_precision=DOT) * scale  # [GP, BLOCK]
                scores = tl.where(seen[None, :], scores, NEG)
                m_new = tl.maximum(m, tl.max(scores, 1))
                alpha = tl.exp(m - m_new)
                p = tl.where(seen[None, :], tl.exp(scores - m_new[:, None]), 0.0)
                l = l * alpha + tl.sum(p, 1)  # noqa: E741
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT)
                m = m_new
        part = (r * HEADS + heads) * PARTS + first  # [GP]
        tl.store(acc_ptr + part[:, None] * D + d[None, :], acc, mask=live[:, None])
        tl.store(ml_ptr + 2 * part, m, mask=live)
        tl.store(ml_ptr + 2 * part + 1, l, mask=live)


@triton.jit
def _combine_kernel(
    acc_ptr, ml_ptr, end_ptr, out_ptr, split_keys,
    HEADS: tl.constexpr, D: tl.constexpr, PARTS: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    h = tl.program_id(1)
    end = tl.load(end_ptr + r)
    d = tl.arange(0, D)
    if end == 0:  # a padding row: zeros, so that the layers after it stay finite
        tl.store(out_ptr + (r * HEADS + h) * D + d, tl.zeros([D], out_ptr.dtype.element_ty))
    else:
        first = tl.arange(0, PARTS)
        used = first * split_keys < end  # programs past the row's last key wrote nothing
        part = (r * HEADS + h) * PARTS + first
        m = tl.load(ml_ptr + 2 * part, mask=used, other=NEG)
        l = tl.load(ml_ptr + 2 * part + 1, mask=used, other=0.0)  # noqa: E741
        acc = tl.load(acc_ptr + part[:, None] * D + d[None, :], mask=used[:, None], other=0.0)
        w = tl.exp(m - tl.max(m, 0))  # [PARTS]
        out = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)  # [D]
        tl.store(out_ptr + (r * HEADS + h) * D + d, out.to(out_ptr.dtype.element_ty))


def paged_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    table: torch.Tensor,
    row_seq: torch.Tensor,
    limit: torch.Tensor,
    end: torch.Tensor,
    tree: torch.Tensor,
    block_size: int,
    split_keys: int,
    rows: int | None = None,
) -> torch.Tensor:
    """q [T, H, D] (after RoPE) -> [T, H, D], softmax(q K^T / sqrt(D)) V for each row over
    the keys it sees. table [B, W] block tables; row_seq/limit/end/tree [T] per row (end:
    one past the last key the row sees; 0 for a padding row, whose output is 0). Only the
    first `rows` rows (all where None) are computed."""
    total, heads, dim = q.shape
    rows = total if rows is None else rows
    kv_heads = k_pool.shape[1]
    group = heads // kv_heads
    acc = torch.empty(rows, heads, PARTS, dim, device=q.device, dtype=torch.float32)
    ml = torch.empty(rows, heads, PARTS, 2, device=q.device, dtype=torch.float32)
    out = torch.empty_like(q)
    if rows == 0:
        return out
    _split_kernel[(rows, kv_heads, PARTS)](
        q, k_pool, v_pool, table, row_seq, limit, end, tree, acc, ml,
        table.stride(0), block_size, split_keys, 1.0 / math.sqrt(dim),
        HEADS=heads, KV_HEADS=kv_heads, GROUP=group, GP=max(16, triton.next_power_of_2(group)),
        D=dim, BLOCK=BLOCK_N, DOT="ieee" if q.dtype == torch.float32 else "tf32", PARTS=PARTS,
        **FP_FUSION,
    )  # fmt: skip
    _combine_kernel[(rows, heads)](
        acc, ml, end, out, split_keys, HEADS=heads, D=dim, PARTS=PARTS, **FP_FUSION,
    )  # fmt: skip
    return out
