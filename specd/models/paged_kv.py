"""The K/V tensors of a paged cache, and the index tensors one batched forward needs.

Per layer a pool `[num_blocks, block_size, kv_heads, head_dim]` for K and for V, addressed
by the slot numbers `specd.kvcache.BlockAllocator` hands out. A forward takes a batch of
sequences with different query lengths (prefill chunk n, decode 1, verification k+1);
`BatchPlan.build` appends their tokens to the allocator and turns block tables into
slot indices, positions and the attention mask, once per forward for all layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specd.kvcache import BlockAllocator
from specd.models.attention import MAX_ROWS, PagedRows

KV_TILE = 512  # batch-invariant mode pads keys to the CPU flash-attention block size


class PagedKV:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.allocator = BlockAllocator(num_blocks, block_size)
        shape = (num_blocks * block_size, kv_heads, head_dim)  # flat view of the block pool
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @classmethod
    def for_model(cls, model, num_blocks: int, block_size: int = 16) -> PagedKV:
        a = model.args
        return cls(
            a.num_layers,
            num_blocks,
            block_size,
            a.num_kv_heads,
            a.head_dim,
            model.dtype,
            model.device,
        )

    def move(self, seq_id, moves: list[tuple[int, int]]) -> None:
        """Copy the K/V of positions to other positions of the same sequence, every layer:
        moves = [(from, to)]. Used to put an accepted tree branch where a chain would be."""
        if not moves:
            return
        slots = self.allocator.slots
        src = torch.tensor([slots(seq_id, a, a + 1)[0] for a, _ in moves], dtype=torch.long)
        dst = torch.tensor([slots(seq_id, b, b + 1)[0] for _, b in moves], dtype=torch.long)
        src, dst = src.to(self.k[0].device), dst.to(self.k[0].device)
        for pool in (*self.k, *self.v):
            pool.index_copy_(0, dst, pool.index_select(0, src))

    @staticmethod
    def blocks_for_budget(model, budget_bytes: int, block_size: int = 16) -> int:
        a = model.args
        per_block = 2 * a.num_layers * block_size * a.num_kv_heads * a.head_dim
        return max(1, budget_bytes // (per_block * model.dtype.itemsize))


@dataclass
class SeqInput:
    """One sequence's part of a forward: `tokens` are appended after what is cached;
    logits come back for its last `num_logits` new tokens (0 for a non-final prefill chunk).

    `parents` makes the new tokens a tree (several candidate continuations verified in one
    forward): parents[i] is the index in `tokens` of token i's parent, -1 for the last
    cached token, always < i. A token sits at the position after its parent's and attends
    to the cache and its own ancestors only. None: a chain (parents[i] = i - 1)."""

    seq_id: object
    tokens: list[int]
    num_logits: int = 1
    parents: list[int] | None = None

    def depths(self) -> list[int]:
        """Offset of each new token's position from the first one's."""
        if self.parents is None:
            return list(range(len(self.tokens)))
        depth: list[int] = []
        for i, parent in enumerate(self.parents):
            if not -1 <= parent < i:
                raise ValueError(f"token {i}'s parent {parent} is not an earlier token")
            depth.append(0 if parent < 0 else depth[parent] + 1)
        return depth

    def ancestry(self) -> torch.Tensor:
        """bool [n, n]: [i, j] when new token j is token i or one of its ancestors."""
        n = len(self.tokens)
        if self.parents is None:
            return torch.ones(n, n, dtype=torch.bool).tril()
        seen = torch.zeros(n, n, dtype=torch.bool)
        for i, parent in enumerate(self.parents):
            if parent >= 0:
                seen[i] = seen[parent]
            seen[i, i] = True
        return seen


@dataclass
class BatchPlan:
    input_ids: torch.Tensor  # [T] flat new tokens of all sequences
    positions: torch.Tensor  # [T] their absolute positions
    write_slots: torch.Tensor  # [T] where their K/V go in the flat pool
    kv_slots: torch.Tensor  # [B, L_max] slots of every cached + new position (padded)
    attn_mask: torch.Tensor | None  # [B, 1, Q_max, L_max] bool; None when no mask is needed
    pad_index: torch.Tensor | None  # [T] row in the padded [B*Q_max] query layout; None if B=1
    logits_index: torch.Tensor  # [R] rows of the flat T whose logits are returned
    batch: int
    q_max: int
    paged: PagedRows | None = None  # set when attention reads the pool in place

    @classmethod
    def build(
        cls,
        allocator: BlockAllocator,
        seqs: list[SeqInput],
        device,
        q_tile: int = 0,
        paged: bool = False,
    ) -> BatchPlan:
        """Append every sequence's tokens to the allocator (all or nothing) and index them.
        paged (the caller can run specd.models.attention's kernel): a step of at most
        MAX_ROWS new tokens per sequence gets `PagedRows` and no mask or padding. Else, for
        SDPA: q_tile > 0 (batch-invariant mode) pads every sequence's queries to a multiple
        of q_tile and always masks, so attention has the same shapes for 1 or k+1 queries."""
        appended = []
        try:
            spans = []
            for s in seqs:
                if not s.tokens:
                    raise ValueError(f"sequence {s.seq_id!r} has no tokens to run")
                if not 0 <= s.num_logits <= len(s.tokens):
                    raise ValueError(f"num_logits {s.num_logits} outside [0, {len(s.tokens)}]")
                spans.append(allocator.append(s.seq_id, len(s.tokens)))
                appended.append(s)
        except Exception:
            for s in appended:
                allocator.truncate_to(s.seq_id, allocator.length(s.seq_id) - len(s.tokens))
            raise
        paged = paged and max(len(s.tokens) for s in seqs) <= MAX_ROWS
        return cls._index(allocator, seqs, spans, device, 0 if paged else q_tile, paged)

    @classmethod
    def _index(cls, allocator, seqs, spans, device, q_tile=0, paged=False) -> BatchPlan:
        bs, batch = allocator.block_size, len(seqs)
        q_max, l_max = max(len(s.tokens) for s in seqs), max(end for _, end in spans)
        if q_tile:  # batch-invariant: fixed attention shapes (padded keys are masked out)
            q_max, l_max = -(-q_max // q_tile) * q_tile, -(-l_max // KV_TILE) * KV_TILE

        table = torch.zeros(batch, -(-l_max // bs), dtype=torch.long)
        ids, positions, logits_rows, pad_rows = cls._rows(allocator, seqs, spans, q_max, table)

        # slot of position p in sequence b = table[b, p // bs] * bs + p % bs
        cols = torch.arange(l_max)
        kv_slots = table[:, cols // bs] * bs + cols % bs  # [B, L_max]
        write_slots = torch.cat([kv_slots[b, start:end] for b, (start, end) in enumerate(spans)])

        def dev(t):
            t = torch.tensor(t, dtype=torch.long) if isinstance(t, list) else t
            return t.to(device, non_blocking=True)

        plan = cls(
            input_ids=dev(ids),
            positions=dev(positions),
            write_slots=dev(write_slots),
            kv_slots=dev(kv_slots),
            attn_mask=None,
            pad_index=None,
            logits_index=dev(logits_rows),
            batch=batch,
            q_max=q_max,
        )
        if paged:
            ancestries = [None if s.parents is None else s.ancestry() for s in seqs]
            plan.paged = PagedRows.build(dev(table), bs, spans, ancestries)
            return plan
        if (mask := cls._mask(seqs, spans, q_max, cols, bool(q_tile))) is not None:
            plan.attn_mask = dev(mask)
        if batch > 1 or q_tile:
            plan.pad_index = dev(pad_rows)
        return plan

    @staticmethod
    def _rows(allocator, seqs, spans, q_max: int, table: torch.Tensor):
        """The step's rows, sequence after sequence: token ids, positions, the rows whose
        logits are wanted, each row's place in a [B * Q_max] padded layout. Fills each
        sequence's block table into `table`."""
        bs = allocator.block_size
        ids, positions, logits_rows, pad_rows, offset = [], [], [], [], 0
        for b, (s, (start, end)) in enumerate(zip(seqs, spans, strict=True)):
            ids.extend(s.tokens)
            positions.extend(start + d for d in s.depths())
            n = end - start
            logits_rows.extend(range(offset + n - s.num_logits, offset + n))
            pad_rows.extend(range(b * q_max, b * q_max + n))
            blocks = allocator.block_table(s.seq_id)[: -(-end // bs)]
            table[b, : len(blocks)] = torch.tensor(blocks, dtype=torch.long)
            offset += n
        return ids, positions, logits_rows, pad_rows

    @staticmethod
    def _mask(seqs, spans, q_max: int, cols: torch.Tensor, tiled: bool) -> torch.Tensor | None:
        """The SDPA mask [B, 1, Q_max, L_max], or None when plain causal attention of one
        row per sequence over equal lengths needs none."""
        q_lens = [len(s.tokens) for s in seqs]
        trees = [b for b, s in enumerate(seqs) if s.parents is not None]
        if not (tiled or trees) and q_max == 1 and len({end for _, end in spans}) == 1:
            return None
        # query i of sequence b sits at position start_b + i and sees keys j <= it;
        # padded query rows (i >= n_b) repeat the last real row's view (never empty).
        starts = torch.tensor([start for start, _ in spans])
        n_b = torch.tensor(q_lens)
        qi = torch.arange(q_max)
        qpos = starts[:, None] + torch.minimum(qi[None, :], n_b[:, None] - 1)  # [B, Q_max]
        mask = (cols[None, None, :] <= qpos[:, :, None]).unsqueeze(1)  # [B,1,Q,L]
        for b in trees:  # a tree's new keys: ancestors only (the cache stays visible)
            (start, end), n = spans[b], q_lens[b]
            seen = seqs[b].ancestry()
            mask[b, 0, :n, start:end] = seen
            mask[b, 0, n:, start:end] = seen[-1]
        return mask
