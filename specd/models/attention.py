"""Attention read in place from the paged K/V pool, for every step on a CPU with the kernel.

Decode (1 row), verification (k+1 rows, or a tree of at most `MAX_ROWS` new tokens) and
prefill chunks (a chain of any length) go to `kernels/paged_attention.cpp`: no gather of
the keys into a padded batch, no mask tensor, no padded queries, and every query row
computed on its own, so a row's result is the same alone or beside others (batch
invariance without the padded shapes that SDPA needed for it), and a prompt prefilled in
one chunk, in several, or after a cached prefix rounds the same (specd.kvcache's prefix
cache relies on it). Measured against SDPA for a prefill (1.5B, int4, 2 AVX2 cores):
128 tokens 1.75 vs 1.93 s, 512 tokens 7.6 vs 6.8 s (docs/benchmarks-log.md section 25). Trees
wider than MAX_ROWS and devices without the kernel use SDPA (specd.models.llama).

`reference` is the same maths in plain torch, for the tests.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from specd.models.native import cpu_isa, kernel

MAX_ROWS = 64  # new tokens per sequence; a tree's visibility is one 64-bit mask per row


@dataclass
class PagedRows:
    """Which keys each query row sees: sequence b owns rows seq_rows[b]..seq_rows[b+1];
    row r sees keys j < limit[r] and key limit[r] + i for each bit i set in tree[r]."""

    table: torch.Tensor  # int64 [B, blocks]: each sequence's block table
    block_size: int
    seq_rows: torch.Tensor  # int64 [B + 1]
    limit: torch.Tensor  # int64 [T]
    tree: torch.Tensor  # int64 [T], read as 64 bits

    @classmethod
    def build(cls, table, block_size, spans, ancestries) -> PagedRows:
        """spans[b] = (first new position, kv length); ancestries[b]: bool [n, n] of a
        tree's new tokens, or None for a chain."""
        rows, limit, tree = visibility(spans, ancestries)
        as_long = lambda v: torch.tensor(v, dtype=torch.long)  # noqa: E731
        return cls(table, block_size, as_long(rows), as_long(limit), as_long(tree))


def visibility(spans, ancestries) -> tuple[list[int], list[int], list[int]]:
    """PagedRows' row fields as lists: (seq_rows [B + 1], limit [T], tree [T] as signed
    64-bit integers), for spans[b] = (first new position, kv length) and ancestries[b]
    (bool [n, n] of a tree's new tokens, or None for a chain)."""
    rows, limit, tree = [0], [], []
    for (start, end), seen in zip(spans, ancestries, strict=True):
        n = end - start
        rows.append(rows[-1] + n)
        if seen is None:  # a chain: new token i sees everything up to itself
            limit.extend(range(start + 1, end + 1))
            tree.extend([0] * n)
            continue
        weights = 1 << torch.arange(n, dtype=torch.int64)
        bits = (seen.long() * weights).sum(-1).tolist()
        limit.extend([start] * n)
        tree.extend(b - (1 << 64) if b >= 1 << 63 else b for b in bits)
    return rows, limit, tree


def available(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Can steps of this model take the kernel? (SPECD_NO_PAGED_ATTENTION=1: never.)"""
    if os.environ.get("SPECD_NO_PAGED_ATTENTION"):
        return False
    shape_ok = head_dim % 16 == 0 and head_dim <= 256
    dtype_ok = dtype in (torch.bfloat16, torch.float32)
    cpu_ok = device.type == "cpu" and cpu_isa() is not None
    return cpu_ok and shape_ok and dtype_ok and kernel() is not None


def paged_attention(q, k_pool, v_pool, rows: PagedRows) -> torch.Tensor:
    """q [T, H, D] (after RoPE) -> [T, H, D], softmax(q K^T / sqrt(D)) V per row."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    return kernel().paged_attention(
        q.contiguous(), k_pool, v_pool, rows.table, rows.block_size, rows.seq_rows,
        rows.limit, rows.tree, scale,
    )  # fmt: skip


def reference(q, k_pool, v_pool, rows: PagedRows) -> torch.Tensor:
    """The kernel's maths, one row at a time, in fp64."""
    out = torch.empty_like(q)
    group = q.shape[1] // k_pool.shape[1]
    bs = rows.block_size
    for b in range(rows.table.shape[0]):
        for r in range(int(rows.seq_rows[b]), int(rows.seq_rows[b + 1])):
            limit, bits = int(rows.limit[r]), int(rows.tree[r]) % (1 << 64)
            keys = list(range(limit)) + [limit + i for i in range(64) if bits >> i & 1]
            slots = torch.tensor([int(rows.table[b, j // bs]) * bs + j % bs for j in keys])
            k = k_pool[slots].double().repeat_interleave(group, dim=1)  # [L, H, D]
            v = v_pool[slots].double().repeat_interleave(group, dim=1)
            s = torch.einsum("hd,lhd->hl", q[r].double(), k) / math.sqrt(q.shape[-1])
            out[r] = torch.einsum("hl,lhd->hd", s.softmax(-1), v).to(q.dtype)
    return out
