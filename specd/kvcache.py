"""Paged KV cache bookkeeping: a block pool, one block table per sequence, a free list,
and a prefix cache of full blocks.

Plain Python, no torch: the K/V tensors live in `specd.models.paged_kv`, indexed by the
slot numbers this module hands out (slot = block * block_size + offset). Keeping the
bookkeeping torch-free makes leak tests run in milliseconds.

Terms:
  length    tokens whose K/V are written (or about to be, within the current forward)
  reserved  tokens the sequence's blocks can hold: ceil(length / block_size) <= blocks

Prefix cache (`prefix_cache=True`, as vLLM's automatic prefix caching and llama-server's
prompt cache): a full block whose K/V are final is `publish`ed under a key that names
every token up to its end (a hash chain: key_i = H(key_{i-1}, tokens of block i)). A new
sequence `allocate`d with its tokens starts on the published blocks of its longest cached
prefix instead of computing them; blocks are shared by reference count and never written
while shared (a sequence only writes past its cached prefix). A published block that no
sequence holds is idle: it counts as free, keeps its K/V until the pool needs it, and the
least recently released goes first. A sequence allocated with a salt starts its chain
from the salt's key instead of the empty one: only sequences of the same salt share
blocks (vLLM's cache_salt).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

_ROOT = b""  # the key before a sequence's first block


def block_key(parent: bytes, tokens) -> bytes:
    """The key of a full block: its tokens and, through `parent`, every token before."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


def root_key(salt: str) -> bytes:
    """The key a sequence's chain starts from: the empty one, else its salt's."""
    if not salt:
        return _ROOT
    return hashlib.blake2b(salt.encode(), digest_size=16, person=b"specd-salt").digest()


class NoFreeBlocks(RuntimeError):
    """The pool cannot hold what was asked; nothing was allocated."""


@dataclass
class _Seq:
    blocks: list[int] = field(default_factory=list)
    length: int = 0
    keys: list[bytes] = field(default_factory=list)  # keys of its first len(keys) blocks
    root: bytes = _ROOT  # the key before its first block (root_key of its salt)


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int, prefix_cache: bool = False):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_cache = prefix_cache
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() takes block 0 first
        self._seqs: dict[int | str, _Seq] = {}
        self._refs = [0] * num_blocks  # sequences holding each block
        self._key_of: dict[int, bytes] = {}  # published block -> key
        self._block_of: dict[bytes, int] = {}  # key -> published block
        self._idle: OrderedDict[int, None] = OrderedDict()  # published, unheld; LRU first
        self.cached_tokens = 0  # prompt tokens served from the prefix cache, since start
        self.asked_tokens = 0  # prompt tokens of the allocations that looked

    # -- queries ---------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._idle)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_idle(self) -> int:
        """Published blocks no sequence holds (free, K/V kept for a later prefix)."""
        return len(self._idle)

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

    def cached_prefix(self, tokens, salt: str = "") -> int:
        """How many of `tokens` a sequence allocated now would find cached (0 without the
        prefix cache); changes nothing."""
        if not self.prefix_cache:
            return 0
        return len(self._match(tokens, root_key(salt))[0]) * self.block_size

    # -- changes ---------------------------------------------------------------------
    def allocate(self, seq_id, reserve_tokens: int = 0, tokens=(), salt: str = "") -> int:
        """Register a new sequence holding blocks for `reserve_tokens`. With the prefix
        cache on, `tokens` (what the sequence may take from the cache; the caller leaves
        out what it must compute) start on the published blocks of their longest cached
        prefix under `salt`: -> the sequence's length, the tokens found (0 without)."""
        if seq_id in self._seqs:
            raise KeyError(f"sequence {seq_id!r} already allocated")
        root = root_key(salt)
        hits, keys = self._match(tokens, root) if self.prefix_cache else ([], [])
        need = max(0, self.blocks_for(reserve_tokens) - len(hits))
        free = self.num_free - sum(1 for b in hits if self._refs[b] == 0)
        if need > free:
            raise NoFreeBlocks(f"need {need} blocks, {free} free")
        for b in hits:
            self._hold(b)
        blocks = hits + [self._take() for _ in range(need)]
        length = len(hits) * self.block_size
        self._seqs[seq_id] = _Seq(blocks=blocks, length=length, keys=keys, root=root)
        if self.prefix_cache:
            self.asked_tokens += len(tokens)
            self.cached_tokens += length
        return length

    def reserve(self, seq_id, total_tokens: int) -> None:
        """Make sure the sequence's blocks can hold `total_tokens` (all or nothing)."""
        seq = self._seqs[seq_id]
        need = self.blocks_for(total_tokens) - len(seq.blocks)
        if need > self.num_free:
            raise NoFreeBlocks(f"need {need} blocks, {self.num_free} free")
        for _ in range(max(0, need)):
            seq.blocks.append(self._take())

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
        full = num_tokens // self.block_size  # blocks kept whole; past them may be rewritten
        if len(seq.keys) > full:
            if full < len(seq.blocks) and num_tokens % self.block_size:
                self._unpublish(seq.blocks[full])  # a kept block whose tail will change
            del seq.keys[full:]
        seq.length = num_tokens
        keep = self.blocks_for(num_tokens)
        while len(seq.blocks) > keep:
            self._release(seq.blocks.pop())

    def publish(self, seq_id, tokens) -> None:
        """The sequence's K/V are final up to its length and are those of `tokens` (its
        tokens from position 0; more than its length is fine, fewer stops there): put the
        full blocks among them in the prefix cache (no-op when it is off). The caller
        never truncates below what it published."""
        if not self.prefix_cache:
            return
        seq, bs = self._seqs[seq_id], self.block_size
        for i in range(len(seq.keys), min(len(tokens), seq.length) // bs):
            key = block_key(seq.keys[-1] if seq.keys else seq.root, tokens[i * bs : (i + 1) * bs])
            seq.keys.append(key)
            block = seq.blocks[i]
            if key not in self._block_of and block not in self._key_of:
                self._block_of[key], self._key_of[block] = block, key

    def free(self, seq_id) -> None:
        """Release every block of the sequence; unknown ids are ignored (idempotent). Its
        published blocks stay cached (its first block is released last, so kept longest)."""
        seq = self._seqs.pop(seq_id, None)
        if seq is not None:
            for b in reversed(seq.blocks):
                self._release(b)

    def forget_cached(self) -> int:
        """Forget every cached prefix (vLLM's reset_prefix_cache, SGLang's flush_cache):
        no later allocation finds a block published before. Blocks no sequence holds are
        free again; running sequences keep theirs. (What a running sequence publishes
        later chains from keys forgotten: found only after a later sequence computes its
        prefix again, the same content.) -> the blocks forgotten."""
        forgotten = len(self._key_of)
        self._free.extend(self._idle)
        self._idle.clear()
        self._key_of.clear()
        self._block_of.clear()
        return forgotten

    # -- blocks ----------------------------------------------------------------------
    def _match(self, tokens, root: bytes) -> tuple[list[int], list[bytes]]:
        """Published blocks of the longest cached prefix of `tokens` from `root`, and
        their keys."""
        bs, blocks, keys = self.block_size, [], []
        for i in range(len(tokens) // bs):
            key = block_key(keys[-1] if keys else root, tokens[i * bs : (i + 1) * bs])
            block = self._block_of.get(key)
            if block is None:
                break
            blocks.append(block)
            keys.append(key)
        return blocks, keys

    def _hold(self, block: int) -> None:
        if self._refs[block] == 0:
            self._idle.pop(block, None)
        self._refs[block] += 1

    def _take(self) -> int:
        """A block for new K/V: a never-published one first, else the least recently
        released cached one (its key forgotten)."""
        if self._free:
            block = self._free.pop()
        else:
            block, _ = self._idle.popitem(last=False)
            self._unpublish(block)
        self._refs[block] = 1
        return block

    def _release(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            if block in self._key_of:
                self._idle[block] = None
            else:
                self._free.append(block)

    def _unpublish(self, block: int) -> None:
        if self._refs[block] > 1:
            raise RuntimeError(f"block {block} is shared: its K/V cannot change")
        key = self._key_of.pop(block, None)
        if key is not None:
            del self._block_of[key]
