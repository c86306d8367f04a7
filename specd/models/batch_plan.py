"""The index tensors one batched forward needs: `BatchPlan.build` appends each sequence's
new tokens (`SeqInput`) to the block allocator and turns block tables into slot indices,
positions and the attention mask, once per forward for all layers."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specd.kvcache import BlockAllocator
from specd.models.attention import MAX_ROWS, PagedRows
from specd.models.seq_input import SeqInput

KV_TILE = 512  # batch-invariant mode pads keys to the CPU flash-attention block size
_NO_SLOTS = torch.empty(0, dtype=torch.long)  # a paged plan's kv_slots: attention reads the table


@dataclass
class BatchPlan:
    input_ids: torch.Tensor  # [T] flat new tokens of all sequences
    positions: torch.Tensor  # [T] their absolute positions
    write_slots: torch.Tensor  # [T] where their K/V go in the flat pool
    kv_slots: torch.Tensor  # [B, L_max] slots of every cached + new position (padded; paged: empty)
    attn_mask: torch.Tensor | None  # [B, 1, Q_max, L_max] bool; None when no mask is needed
    pad_index: torch.Tensor | None  # [T] row in the padded [B*Q_max] query layout; None if B=1
    logits_index: torch.Tensor  # [R] rows of the flat T whose logits are returned
    batch: int
    q_max: int
    paged: PagedRows | None = None  # set when attention reads the pool in place
    end: int = 0  # one past the largest position of any row

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
        paged (the caller can run specd.models.attention's kernel): the step gets
        `PagedRows` and no mask or padding, unless a tree has more than MAX_ROWS new tokens
        (a chain of any length, a prefill chunk too, takes the kernel). Else, for
        SDPA: q_tile > 0 (batch-invariant mode) pads every sequence's queries to a multiple
        of q_tile and always masks, so attention has the same shapes for 1 or k+1 queries."""
        spans = append_all(allocator, seqs)
        if paged and all(s.parents is None or len(s.tokens) <= MAX_ROWS for s in seqs):
            plan = cls._index_paged(allocator, seqs, spans, device)
        else:
            plan = cls._index(allocator, seqs, spans, device, q_tile)
        plan.end = max(end for _, end in spans)
        return plan

    @classmethod
    def _index_paged(cls, allocator, seqs, spans, device) -> BatchPlan:
        """For specd.models.attention's kernel: the rows and the block tables only (no key
        slots, mask or padding), from Python lists, one tensor each: every draft and every
        decode step builds one, and the general plan's tensor ops took ~0.2 ms of a 0.5B
        drafter's 9 ms forward."""
        bs = allocator.block_size
        q_max = max(len(s.tokens) for s in seqs)
        ids, positions, logits_rows, _, write_slots, blocks = step_rows(
            allocator, seqs, spans, q_max
        )
        width = max(len(b) for b in blocks)
        table = [b + [0] * (width - len(b)) for b in blocks]

        def dev(values):
            return _on(device, values)

        ancestries = [None if s.parents is None else s.ancestry() for s in seqs]
        return cls(
            input_ids=dev(ids),
            positions=dev(positions),
            write_slots=dev(write_slots),
            kv_slots=_NO_SLOTS,
            attn_mask=None,
            pad_index=None,
            logits_index=dev(logits_rows),
            batch=len(seqs),
            q_max=q_max,
            paged=PagedRows.build(dev(table), bs, spans, ancestries),
        )

    @classmethod
    def _index(cls, allocator, seqs, spans, device, q_tile=0) -> BatchPlan:
        bs, batch = allocator.block_size, len(seqs)
        q_max, l_max = max(len(s.tokens) for s in seqs), max(end for _, end in spans)
        if q_tile:  # batch-invariant: fixed attention shapes (padded keys are masked out)
            q_max, l_max = -(-q_max // q_tile) * q_tile, -(-l_max // KV_TILE) * KV_TILE

        rows = step_rows(allocator, seqs, spans, q_max)
        ids, positions, logits_rows, pad_rows, write_slots, blocks = rows
        width = -(-l_max // bs)
        table = torch.tensor([b + [0] * (width - len(b)) for b in blocks], dtype=torch.long)

        # slot of position p in sequence b = table[b, p // bs] * bs + p % bs
        cols = torch.arange(l_max)
        kv_slots = table[:, cols // bs] * bs + cols % bs  # [B, L_max]

        def dev(t):
            return _on(device, t)

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
        if (mask := cls._mask(seqs, spans, q_max, cols, bool(q_tile))) is not None:
            plan.attn_mask = dev(mask)
        if batch > 1 or q_tile:
            plan.pad_index = dev(pad_rows)
        return plan

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


def append_all(allocator: BlockAllocator, seqs: list[SeqInput]) -> list[tuple[int, int]]:
    """Append every sequence's new tokens to the allocator, all or nothing (ValueError or
    NoFreeBlocks leave it as it was); -> each sequence's (first new position, kv length)."""
    appended, spans = [], []
    try:
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
    return spans


def step_rows(allocator, seqs, spans, q_max: int):
    """The step's rows, sequence after sequence: token ids, positions, the rows whose
    logits are wanted, each row's place in a [B * Q_max] padded layout, the slots their
    K/V go to; and each sequence's block table as far as the step reaches."""
    bs = allocator.block_size
    ids, positions, logits_rows, pad_rows, write_slots, blocks = [], [], [], [], [], []
    offset = 0
    for b, (s, (start, end)) in enumerate(zip(seqs, spans, strict=True)):
        ids.extend(s.tokens)
        positions.extend(start + d for d in s.depths())
        n = end - start
        logits_rows.extend(range(offset + n - s.num_logits, offset + n))
        pad_rows.extend(range(b * q_max, b * q_max + n))
        table = allocator.block_table(s.seq_id)[: -(-end // bs)]
        write_slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
        blocks.append(list(table))
        offset += n
    return ids, positions, logits_rows, pad_rows, write_slots, blocks


def _on(device, t) -> torch.Tensor:
    """A plan's index (a list of ints, or a tensor) on the step's device."""
    t = torch.tensor(t, dtype=torch.long) if isinstance(t, list) else t
    return t.to(device, non_blocking=True)
