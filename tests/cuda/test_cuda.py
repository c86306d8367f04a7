"""CUDA paths, on a GPU machine (`make test-cuda`; skipped where torch sees no GPU).

Every weight format loads there (the quantised ones as bf16, said in one log line), the
forward matches transformers, and greedy output is the same with speculation on and off
in the default configuration (bf16, batch-invariant), alone and in a batch."""

import logging
import os

import pytest
import torch

from drafter_service.draft_model import DraftModelProposer
from specd.config import EngineConfig
from specd.models.loader import load_model
from specd.models.paged_kv import PagedKV
from specd.models.seq_input import SeqInput
from tests.conftest import make_tiny, make_tiny_pair, run_engine
from verifier_service.engine import Engine

if not torch.cuda.is_available():
    if os.environ.get("SPECD_REQUIRE_CUDA"):
        raise RuntimeError("SPECD_REQUIRE_CUDA is set but torch sees no CUDA device")
    pytest.skip("no CUDA device; `make test-cuda` runs these on a GPU", allow_module_level=True)

PROMPTS = [
    [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9],
    [20, 31, 42, 53, 64, 75, 86],
    [3] * 4 + [11, 12, 13, 14] * 3,
    list(range(40, 90)),
]


def _tensors(model) -> list[torch.Tensor]:
    out = [model.embed, model.norm, model.lm_head]
    for layer in model.layers:
        out += [v for v in vars(layer).values() if isinstance(v, torch.Tensor)]
    return out


@pytest.mark.parametrize("weights", ["bf16", "int8", "int4", "auto"])
def test_every_weight_format_runs_on_cuda(tmp_path, caplog, weights):
    hf = make_tiny("qwen2", tmp_path).to("cuda")
    with caplog.at_level(logging.WARNING, logger="specd.models.weights"):
        model = load_model(tmp_path, device="cuda", weights=weights)
    said = [r.getMessage() for r in caplog.records if "running bf16" in r.getMessage()]
    assert len(said) == (0 if weights == "bf16" else 1), said
    assert model.weights == "bf16"
    for t in _tensors(model):  # nothing quantised, nothing left on the CPU
        assert t.device.type == "cuda" and t.dtype == torch.bfloat16
    assert not list(tmp_path.glob("weights-int*.safetensors"))  # no conversion ran

    ids = [5, 17, 33, 2, 90, 41, 7, 8, 11]
    kv = PagedKV.for_model(model, num_blocks=16, block_size=4)
    kv.allocator.allocate("a")
    got = model.forward(kv, [SeqInput("a", ids, num_logits=len(ids))])
    with torch.no_grad():
        ref = hf(torch.tensor([ids], device="cuda")).logits[0].float()
    assert got.device.type == "cuda"
    assert (got - ref).abs().max() <= 0.03 * ref.abs().max()  # bf16 against fp32
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.8


@pytest.fixture(scope="module")
def cuda_pair(tmp_path_factory):
    """The tiny target and its noisy draft on the GPU in the default dtype (bf16)."""
    folder, draft_folder = make_tiny_pair(tmp_path_factory, "cuda")
    return load_model(folder, device="cuda"), load_model(draft_folder, device="cuda")


def _engine(target, proposer=None) -> Engine:
    return Engine(target, EngineConfig(num_blocks=256, block_size=4), proposer, eos_ids=set())


@pytest.mark.parametrize("k", [1, 3, 6])
@pytest.mark.parametrize("together", [False, True], ids=["alone", "batch"])
def test_greedy_identical_on_and_off_in_the_default_configuration(cuda_pair, k, together):
    target, draft = cuda_pair
    assert target.dtype == torch.bfloat16 and EngineConfig().batch_invariant
    reqs = [dict(prompt=p, max_new_tokens=40) for p in PROMPTS]
    groups = [reqs] if together else [[r] for r in reqs]
    off, on = [], []
    totals = [0, 0]
    for group in groups:
        off += run_engine(_engine(target), group).values()
        proposer = DraftModelProposer(draft, num_blocks=128, block_size=4)
        engine = _engine(target, proposer)
        on += run_engine(engine, [dict(r, num_draft=k) for r in group]).values()
        totals[0] += engine.totals.drafted
        totals[1] += engine.totals.accepted
        assert engine.kv.allocator.num_used == 0 and proposer.kv.allocator.num_used == 0
    assert on == off
    assert 0 < totals[1] < totals[0]  # speculation ran, and rejected some drafts


def test_the_default_step_is_graphs_over_triton_kernels(cuda_pair, caplog):
    """bf16, the default tile: a decode row is the same bits alone, beside a verification
    and a prefill chunk, eagerly and replayed from a captured graph; capture is logged."""
    from specd.models.gpu.graphs import StepGraphs

    target, _ = cuda_pair
    assert target.gpu is not None and target.gpu.invariant and target.chunk_invariant()

    def decode_b(batch: bool, graphs: bool):
        kv = PagedKV.for_model(target, num_blocks=64, block_size=4)
        for s in ("b", "a", "c"):
            kv.allocator.allocate(s)
        target.forward(kv, [SeqInput("b", list(range(5, 25)), 1)])
        target.forward(kv, [SeqInput("a", list(range(30, 40)), 1)])
        if graphs:
            with caplog.at_level(logging.INFO, logger="specd.models.gpu.graphs"):
                target.gpu.graphs = StepGraphs(target.gpu, kv, max_seqs=4, max_rows=24)
            assert target.gpu.graphs.graphs[1] is not None  # captured
        rest = [SeqInput("a", [8, 9, 10], 3), SeqInput("c", list(range(40, 52)), 1)]
        out = target.forward(kv, [SeqInput("b", [7], 1)] + (rest if batch else []))[0]
        target.gpu.graphs = None
        return out

    alone = decode_b(False, False)
    for batch, graphs in ((True, False), (False, True), (True, True)):
        assert torch.equal(alone, decode_b(batch, graphs)), (batch, graphs)
    assert any("CUDA graphs" in r.getMessage() for r in caplog.records)


def test_queued_forwards_from_graphs_give_what_waited_ones_give(cuda_pair):
    """A GPU's forward returns with its step queued (the engine hands the last step's
    outputs on while it runs, then waits): steps queued back to back from the graphs, each
    packing its inputs into the staging rows the one before copies from, give the logits
    that steps waited for one at a time give."""
    from specd.models.gpu.graphs import StepGraphs

    target, _ = cuda_pair
    assert target.queued

    def decode(wait: bool) -> list[torch.Tensor]:
        kv = PagedKV.for_model(target, num_blocks=64, block_size=4)
        for s in ("a", "b"):
            kv.allocator.allocate(s)
        target.forward(kv, [SeqInput("a", list(range(5, 25)), 1), SeqInput("b", [3] * 9, 1)])
        target.gpu.graphs = StepGraphs(target.gpu, kv, max_seqs=2, max_rows=8)
        outs = []
        for i in range(12):  # fixed tokens: no step reads the one before's logits
            seqs = [SeqInput("a", [30 + i], 1), SeqInput("b", [40 + i, 41 + i], 2)]
            outs.append(target.forward(kv, seqs))
            if wait:
                target.synchronize()
        target.synchronize()
        target.gpu.graphs = None
        return [o.cpu() for o in outs]

    waited, queued = decode(True), decode(False)
    assert all(torch.equal(a, b) for a, b in zip(waited, queued, strict=True))


def test_a_share_of_the_gpus_memory_sizes_the_pool_and_serves(tmp_path_factory):
    """--gpu-memory-utilization on the GPU itself: the pool takes what the share leaves
    (more than the default's room for the context), and a batch runs in it, graphs and all,
    with the GPU's memory in use under the share."""
    target_dir, _ = make_tiny_pair(tmp_path_factory, "gpu-share")
    target = load_model(target_dir, device="cuda")
    total = torch.cuda.mem_get_info()[1]
    engine = Engine(target, EngineConfig(gpu_memory_utilization=0.2), None, eos_ids=set())
    pool = engine.kv.allocator.num_blocks * PagedKV.bytes_per_block(target, 16)
    assert pool > 0.1 * total  # the tiny model's weights take next to nothing
    out = run_engine(engine, [dict(prompt=p, max_new_tokens=8) for p in PROMPTS])
    assert all(len(v) == 8 for v in out.values())
    assert torch.cuda.memory_reserved() <= 0.2 * total
