"""How large the verifier engine's fixed resources are: the context a request may have,
the KV pool's blocks, and the rows a step may feed (CUDA graphs are captured up to it)."""

from __future__ import annotations

from specd.config import DEFAULT_KV_BYTES, EngineConfig
from specd.models.paged_kv import PagedKV


def graph_rows(config: EngineConfig) -> int:
    """The most rows a decode/verification step feeds: every sequence at the largest k,
    plus the tree's leaves (CUDA graphs are captured up to it)."""
    rows = config.max_batch_size * (config.max_draft_tokens + 1) + config.max_tree_tokens
    return min(rows, config.max_batched_tokens)


def context_and_blocks(model, config: EngineConfig) -> tuple[int, int]:
    """(a request's prompt + generation at most: the model's context, or max_model_len
    where less; the KV pool in blocks: num_blocks, else kv_cache_bytes' worth, else room
    for that context (a request of that many tokens and the slot admission adds) within
    DEFAULT_KV_BYTES)."""
    context = model.args.max_position_embeddings
    context = min(context, config.max_model_len or context)
    bs = config.block_size
    if config.num_blocks:
        return context, config.num_blocks
    if config.kv_cache_bytes:
        return context, PagedKV.blocks_for_budget(model, config.kv_cache_bytes, bs)
    whole = -(-(context + 1) // bs)
    return context, min(whole, PagedKV.blocks_for_budget(model, DEFAULT_KV_BYTES, bs))
