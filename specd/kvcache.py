"""Paged KV cache bookkeeping: a block pool, one block table per sequence, a free list.

Plain Python, no torch: the K/V tensors live in `specd.models.paged_kv`, indexed by the
slot numbers this module hands out (slot = block * block_size + offset). Keeping the
bookkeeping torch-free makes leak tests run in milliseconds.

Terms:
  length    tokens whose K/V are written (or about to be, within the current forward)
  reserved  tokens the sequence's blocks can hold: ceil(length / block_size) <= blocks
"""

from __future__ import annotations

from dataclasses import dataclass, field


class NoFreeBlocks(RuntimeError):
    """The pool cannot hold what was asked; nothing was allocated."""


@dataclass
class _Seq:
    blocks: list[int] = field(default_factory=list)
    length: int = 0


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() takes block 0 first
        self._seqs: dict[int | str, _Seq] = {}

    # -- queries ---------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def utilization(self) -> float:
        return self.num_used / self.num_blocks

    def __contains__(self, seq_id) -> bool:
        return seq_id in self._seqs

    def sequences(self) -> list:
        return list(self._seqs)

    def length(self, seq_id) -> int:
        return self._seqs[seq_id].length

    def block_table(self, seq_id) -> list[int]:
        return list(self._seqs[seq_id].blocks)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def slots(self, seq_id, start: int, end: int) -> list[int]:
        """Slot numbers of token positions [start, end) of a sequence."""
        seq = self._seqs[seq_id]
        if end > len(seq.blocks) * self.block_size:
            raise IndexError(f"positions up to {end} not reserved for {seq_id!r}")
        bs = self.block_size
        return [seq.blocks[p // bs] * bs + p % bs for p in range(start, end)]

    # -- changes ---------------------------------------------------------------------
    def allocate(self, seq_id, reserve_tokens: int = 0) -> None:
        """Register a new sequence (length 0) holding blocks for `reserve_tokens`."""
        if seq_id in self._seqs:
            raise KeyError(f"sequence {seq_id!r} already allocated")
        need = self.blocks_for(reserve_tokens)
        if need > len(self._free):
            raise NoFreeBlocks(f"need {need} blocks, {len(self._free)} free")
        self._seqs[seq_id] = _Seq(blocks=[self._free.pop() for _ in range(need)])

    def reserve(self, seq_id, total_tokens: int) -> None:
        """Make sure the sequence's blocks can hold `total_tokens` (all or nothing)."""
        seq = self._seqs[seq_id]
        need = self.blocks_for(total_tokens) - len(seq.blocks)
        if need > len(self._free):
            raise NoFreeBlocks(f"need {need} blocks, {len(self._free)} free")
        for _ in range(max(0, need)):
            seq.blocks.append(self._free.pop())

    def append(self, seq_id, num_tokens: int) -> tuple[int, int]:
        """Grow the sequence by `num_tokens`; returns the new positions as [start, end)."""
        seq = self._seqs[seq_id]
        self.reserve(seq_id, seq.length + num_tokens)
        start = seq.length
        seq.length += num_tokens
        return start, seq.length

    def truncate_to(self, seq_id, num_tokens: int) -> None:
        """Keep the first `num_tokens` positions; free every whole block past them."""
        seq = self._seqs[seq_id]
        if num_tokens < 0 or num_tokens > seq.length:
            raise ValueError(f"truncate_to({num_tokens}) outside [0, {seq.length}]")
        seq.length = num_tokens
        keep = self.blocks_for(num_tokens)
        while len(seq.blocks) > keep:
            self._free.append(seq.blocks.pop())

    def free(self, seq_id) -> None:
        """Release every block of the sequence; unknown ids are ignored (idempotent)."""
        seq = self._seqs.pop(seq_id, None)
        if seq is not None:
            self._free.extend(reversed(seq.blocks))
