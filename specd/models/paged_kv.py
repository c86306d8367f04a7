"""The K/V tensors of a paged cache.

Per layer a pool `[num_blocks, block_size, kv_heads, head_dim]` for K and for V, addressed
by the slot numbers `specd.kvcache.BlockAllocator` hands out. A forward's sequences have
different query lengths (prefill chunk n, decode 1, verification k+1: a `SeqInput`,
specd/models/seq_input.py); `BatchPlan` (specd/models/batch_plan.py) lays them out.

The pools' dtype is the model's `kv_dtype` (`kv_dtype` below): by default the activations'
dtype, except fp16 under fp32 activations (a CPU without bf16 hardware), as llama.cpp's
default cache type: half the bytes, read back as fp32 by the attention."""

from __future__ import annotations

import torch

from specd.config import KV_DTYPES
from specd.kvcache import BlockAllocator
from specd.models.args import parse_dtype


def kv_dtype(name: str, activations: torch.dtype) -> torch.dtype:
    """The K/V pools' dtype for a `--kv-dtype` setting. auto: fp16 under fp32 activations,
    else the activations' own. A 16-bit cache under 16-bit activations must be theirs."""
    if name not in KV_DTYPES:
        raise ValueError(f"kv dtype must be one of {', '.join(KV_DTYPES)}, got {name!r}")
    if name == "auto":
        return torch.float16 if activations == torch.float32 else activations
    chosen = parse_dtype(name, torch.device("cpu"))  # a name, not auto: no device default
    if chosen != activations and activations != torch.float32:
        raise ValueError(
            f"a {name} KV cache needs fp32 activations or {name} ones (they are {activations})"
        )
    return chosen


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
        prefix_cache: bool = False,
    ):
        self.allocator = BlockAllocator(num_blocks, block_size, prefix_cache)
        shape = (num_blocks * block_size, kv_heads, head_dim)  # flat view of the block pool
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @classmethod
    def for_model(
        cls, model, num_blocks: int, block_size: int = 16, prefix_cache: bool = False
    ) -> PagedKV:
        a = model.args
        return cls(
            a.num_layers,
            num_blocks,
            block_size,
            a.num_kv_heads,
            a.head_dim,
            model.kv_dtype,
            model.device,
            prefix_cache,
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
    def bytes_per_block(model, block_size: int = 16) -> int:
        a = model.args
        width = a.num_kv_heads * a.head_dim * model.kv_dtype.itemsize
        return 2 * a.num_layers * block_size * width

    @staticmethod
    def blocks_for_budget(model, budget_bytes: int, block_size: int = 16) -> int:
        return max(1, budget_bytes // PagedKV.bytes_per_block(model, block_size))
