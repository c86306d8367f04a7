"""Typed settings for the services, one dataclass each, validated when built."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineConfig:
    """The verifier's engine: KV pool, batching, speculation."""

    kv_cache_bytes: int = 1 << 30  # target KV pool size (blocks derived from the model)
    num_blocks: int = 0  # > 0 overrides kv_cache_bytes
    block_size: int = 16
    max_batch_size: int = 16  # running sequences
    max_batched_tokens: int = 512  # tokens per forward (prefill chunks + verification)
    max_draft_tokens: int = 8  # upper bound on k per sequence
    batch_invariant: bool = False  # same kernels for decode and verification (bf16 parity)
    drafter_kv_cache_bytes: int = 1 << 29
    draft_top_m: int = 32  # support size of a sampled draft's q

    def __post_init__(self):
        if self.block_size <= 0 or self.max_batch_size <= 0:
            raise ValueError("block_size and max_batch_size must be positive")
        if self.max_batched_tokens < self.max_draft_tokens + 1:
            raise ValueError("max_batched_tokens must hold one verification (k + 1 tokens)")
        if self.max_draft_tokens < 0 or self.draft_top_m <= 0:
            raise ValueError("max_draft_tokens must be >= 0 and draft_top_m > 0")
