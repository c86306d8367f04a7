"""How large the verifier engine's fixed resources are: the context a request may have,
the KV pool's blocks, and the rows a step may feed (CUDA graphs are captured up to it)."""

from __future__ import annotations

import logging

import torch

from specd.config import DEFAULT_KV_BYTES, ConfigError, EngineConfig
from specd.models.paged_kv import PagedKV

log = logging.getLogger(__name__)
# on a GPU, besides the logits and activations of the largest step (workspace_bytes): the
# CUDA context, cuBLAS's and Triton's workspaces, the graphs' memory pool
GPU_OVERHEAD = 1 << 30


def graph_rows(config: EngineConfig) -> int:
    """The most rows a decode/verification step feeds: every sequence at the largest k,
    plus the tree's leaves (CUDA graphs are captured up to it)."""
    rows = config.max_batch_size * (config.max_draft_tokens + 1) + config.max_tree_tokens
    return min(rows, config.max_batched_tokens)


def context_and_blocks(model, config: EngineConfig) -> tuple[int, int]:
    """(a request's prompt + generation at most: the model's context, or max_model_len
    where less; the KV pool in blocks: num_blocks, else kv_cache_bytes' worth, else on a
    GPU what gpu_memory_utilization leaves, else room for that context (a request of that
    many tokens and the slot admission adds) within DEFAULT_KV_BYTES)."""
    context = model.args.max_position_embeddings
    context = min(context, config.max_model_len or context)
    bs = config.block_size
    if config.num_blocks:
        return context, config.num_blocks
    if config.kv_cache_bytes:
        return context, PagedKV.blocks_for_budget(model, config.kv_cache_bytes, bs)
    if config.gpu_memory_utilization:
        if torch.device(model.device).type == "cuda":
            pool = gpu_pool_bytes(model, config, cuda_memory(model.device))
            return context, PagedKV.blocks_for_budget(model, pool, bs)
        log.warning("gpu_memory_utilization is a GPU's: on a CPU the pool is sized as without")
    whole = -(-(context + 1) // bs)
    return context, min(whole, PagedKV.blocks_for_budget(model, DEFAULT_KV_BYTES, bs))


def cuda_memory(device) -> tuple[int, int, int]:
    """(free, total, this process's) bytes of the GPU, the last what torch holds."""
    free, total = torch.cuda.mem_get_info(device)
    return free, total, torch.cuda.memory_reserved(device)


def workspace_bytes(model, config: EngineConfig) -> int:
    """What the largest step takes beside the weights and the pool: fp32 logits of every
    row it feeds (a graph's step computes them all), and a few activations of each row
    (the residual, the gate and up projections), plus GPU_OVERHEAD."""
    a = model.args
    rows = max(graph_rows(config), config.max_batched_tokens)
    per_row = 4 * a.vocab_size + 8 * (a.hidden_size + 2 * a.intermediate_size)
    return rows * per_row + GPU_OVERHEAD


def gpu_pool_bytes(model, config: EngineConfig, memory: tuple[int, int, int]) -> int:
    """The K/V pool under `gpu_memory_utilization` (vLLM's meaning: the share of the GPU's
    memory this process may take), given the GPU's (free, total, this process's) bytes
    once the weights are loaded: the share less what the process holds and the workspace,
    within what is free. ConfigError where that leaves no room."""
    free, total, held = memory
    share = config.gpu_memory_utilization * total
    work = workspace_bytes(model, config)
    pool = int(min(share - held, free) - work)
    gib = 1 << 30
    if pool < PagedKV.bytes_per_block(model, config.block_size):
        raise ConfigError(
            f"gpu_memory_utilization {config.gpu_memory_utilization:g} leaves no room for the "
            f"K/V pool: {share / gib:.1f} GiB of {total / gib:.1f} GiB, {held / gib:.1f} GiB "
            f"held (the weights), {work / gib:.1f} GiB of workspace, {free / gib:.1f} GiB free"
        )
    log.info(
        "K/V pool %.1f GiB: %g of the GPU's %.1f GiB, less %.1f GiB held and %.1f GiB of "
        "workspace", pool / gib, config.gpu_memory_utilization, total / gib, held / gib,
        work / gib,
    )  # fmt: skip
    return pool
