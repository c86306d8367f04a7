"""The engine's sizes where not given. The step's token budget (`max_batched_tokens`):
auto is 128 on a CPU, 512 on a GPU, so that a long prompt's prefill, chunked behind the
decoding sequences' rows, holds them for a forward of at most that many rows. The KV
pool: room for the model's whole context, within DEFAULT_KV_BYTES. A setting is kept as
given."""

from __future__ import annotations

import pytest

from specd.config import EngineConfig, batched_tokens
from specd.models.loader import load_model
from specd.models.paged_kv import PagedKV
from tests.conftest import make_tiny_pair
from verifier_service.engine import Engine
from verifier_service.request import Request
from verifier_service.scheduler import Scheduler


def test_auto_is_by_the_device_and_holds_one_verification():
    assert batched_tokens(EngineConfig(), "cpu") == 128
    assert batched_tokens(EngineConfig(), "cuda") == 512
    assert batched_tokens(EngineConfig(max_batched_tokens=300), "cpu") == 300
    assert batched_tokens(EngineConfig(max_draft_tokens=200), "cpu") == 201
    with pytest.raises(ValueError, match="max_batched_tokens"):
        EngineConfig(max_batched_tokens=-1)


def test_a_scheduler_refuses_a_budget_left_at_auto():
    with pytest.raises(ValueError, match="resolved"):
        Scheduler(None, EngineConfig())


def _rows_while_one_decodes(engine: Engine, prompt: int) -> list[tuple[int, int]]:
    """A short request decodes; a `prompt`-token one arrives. Per step until the second
    has its first token: (rows fed, tokens the first got)."""
    first = engine.add_request(Request(prompt=[5, 6, 7], max_new_tokens=200, ignore_eos=True))
    while not engine.step():  # its prefill, then its first token
        pass
    second = engine.add_request(
        Request(prompt=[(i % 90) + 3 for i in range(prompt)], max_new_tokens=4, ignore_eos=True)
    )
    schedule, fed = engine.scheduler.schedule, []

    def counted(*args, **kwargs):
        slots = schedule(*args, **kwargs)
        fed.append(sum(len(s.tokens) + s.k + s.alts for s in slots))
        return slots

    engine.scheduler.schedule = counted
    steps = []
    while True:
        out = engine.step()
        got = sum(len(o.tokens) for o in out if o.seq_id == first)
        steps.append((fed[-1], got))
        if any(o.seq_id == second and o.tokens for o in out):
            return steps


@pytest.fixture(scope="module")
def rows_alone(cpu_kernels, tmp_path_factory):
    """A tiny target whose rows are each computed alone (int4, the paged attention
    kernel), so that prefill chunks ride in the decoding sequences' step, as served."""
    folder, _ = make_tiny_pair(tmp_path_factory, prefix="budget")
    return load_model(folder, dtype="bf16", device="cpu", weights="int4")


@pytest.mark.parametrize("setting,rows", [(0, 128), (512, 512)])
def test_a_long_prompt_holds_a_decoding_stream_for_at_most_the_budget(rows_alone, setting, rows):
    target = rows_alone  # on the CPU
    engine = Engine(target, EngineConfig(num_blocks=256, max_batched_tokens=setting), eos_ids=set())
    assert engine.config.max_batched_tokens == rows
    steps = _rows_while_one_decodes(engine, prompt=400)
    assert all(fed <= rows for fed, _ in steps)
    assert len(steps) == -(-401 // rows)  # the prompt (and the decoding row) in chunks
    assert all(got == 1 for _, got in steps)  # a token for the first at every one


def test_the_kv_pool_holds_the_models_context_unless_sized_in_blocks_or_bytes(
    tiny_pair, monkeypatch
):
    target, _ = tiny_pair
    per_block = PagedKV.bytes_per_block(target, 16)
    context = target.args.max_position_embeddings
    engine = Engine(target, EngineConfig())
    assert engine.max_context() == context  # a request of the whole context fits
    assert engine.kv.allocator.num_blocks == context // 16 + 1
    # vLLM's --max-model-len: room for that context instead
    engine = Engine(target, EngineConfig(max_model_len=100))
    assert (engine.max_context(), engine.kv.allocator.num_blocks) == (100, -(-101 // 16))
    # within DEFAULT_KV_BYTES
    monkeypatch.setattr("verifier_service.sizing.DEFAULT_KV_BYTES", per_block * 10)
    assert Engine(target, EngineConfig()).kv.allocator.num_blocks == 10
    for config, blocks in (
        (EngineConfig(kv_cache_bytes=per_block * 100 + 1), 100),
        (EngineConfig(kv_cache_bytes=per_block * 100, num_blocks=7), 7),
    ):
        assert Engine(target, config).kv.allocator.num_blocks == blocks
    engine = Engine(target, EngineConfig(num_blocks=4, block_size=4))
    with pytest.raises(ValueError, match="needs 5 KV blocks; the pool has 4 .*--num-blocks"):
        engine.add_request(Request(prompt=[1] * 10, max_new_tokens=6))


def test_a_gpus_memory_share_sizes_the_pool_as_vllms_does(tiny_pair, monkeypatch):
    """--gpu-memory-utilization: the share of the GPU's memory, less what the process holds
    (the weights) and the largest step's workspace, within what is free; refused where that
    leaves no room; ignored on a CPU (the GPU's memory stood in for here)."""
    from specd.config import ConfigError
    from verifier_service import sizing

    target, _ = tiny_pair
    per_block = PagedKV.bytes_per_block(target, 16)
    config = EngineConfig(gpu_memory_utilization=0.5, max_batched_tokens=128)
    work = sizing.workspace_bytes(target, config)
    a = target.args
    assert work == 128 * (4 * a.vocab_size + 8 * (a.hidden_size + 2 * a.intermediate_size)) + (
        sizing.GPU_OVERHEAD
    )
    gib = 1 << 30
    # 80 GiB, 3 GiB held: the pool is 40 - 3 GiB less the workspace
    pool = sizing.gpu_pool_bytes(target, config, (70 * gib, 80 * gib, 3 * gib))
    assert pool == 37 * gib - work
    # never more than is free (another process holds the rest)
    assert sizing.gpu_pool_bytes(target, config, (10 * gib, 80 * gib, 3 * gib)) == 10 * gib - work
    with pytest.raises(ConfigError, match="gpu_memory_utilization 0.5 leaves no room"):
        sizing.gpu_pool_bytes(target, config, (70 * gib, 8 * gib, 3 * gib))
    # the engine on a "GPU": its pool in blocks of that many bytes
    monkeypatch.setattr(target, "device", "cuda")
    monkeypatch.setattr(sizing, "cuda_memory", lambda device: (4 * gib, 8 * gib, gib))
    _, blocks = sizing.context_and_blocks(target, config)
    assert blocks == (3 * gib - work) // per_block
    monkeypatch.setattr(target, "device", "cpu")  # a CPU sizes its pool as without
    assert (
        sizing.context_and_blocks(target, config)[1]
        == sizing.context_and_blocks(target, EngineConfig(max_batched_tokens=128))[1]
    )
