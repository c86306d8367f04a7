"""The GPU step (specd.models.gpu.step) and its graph buckets, on a CPU: the same Python,
the Triton kernels under the interpreter, the graphs run eagerly over their static buffers
(`make test-cuda` runs them compiled and captured). Its forward against the model's own
torch forward; every row the same bits alone and in a batch, eagerly and from a bucket;
padding rows that write no K/V; and the engine's greedy output the same with speculation
on and off when its target runs this step."""

import pytest
import torch

from specd.config import EngineConfig
from specd.models.loader import load_model
from specd.models.paged_kv import PagedKV
from specd.models.seq_input import SeqInput
from tests.conftest import make_tiny, make_tiny_pair, run_engine
from verifier_service.engine import Engine

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def load(folder):
    """A tiny model on DEVICE in fp32, on the torch path (the reference); a test gives it
    a GPU step of its own settings."""
    model = load_model(folder, dtype="fp32", device=DEVICE)
    model.gpu = None
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    # llama3 rope scaling; QKV bias and a tied head; query and key norms, a head_dim of its own
    for kind in ("llama", "qwen2", "qwen3"):
        folder = tmp_path_factory.mktemp(f"gpu-step-{kind}")
        make_tiny(kind, folder)
        out[kind] = load(folder)
    return out


def gpu_step(model, tile=4, split_keys=32):
    from specd.models.gpu.step import GpuStep

    return GpuStep(model, tile=tile, split_keys=split_keys)


def cache(model, *seqs):
    kv = PagedKV.for_model(model, num_blocks=64, block_size=4)
    for s in seqs:
        kv.allocator.allocate(s)
    return kv


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_the_step_matches_the_cpu_forward(triton_ops, models, kind):
    model = models[kind]
    step = gpu_step(model)
    ref_kv, kv = cache(model, "a", "b"), cache(model, "a", "b")
    steps = [  # prefill chunks; then a tree verification beside a decode row
        [SeqInput("a", list(range(3, 40)), num_logits=2), SeqInput("b", [5, 6, 7], 3)],
        [SeqInput("a", [11, 12, 13, 14], 4, parents=[-1, 0, 0, 2]), SeqInput("b", [17], 1)],
    ]
    for seqs in steps:
        want = model.forward(ref_kv, seqs)
        got = step.forward(kv, seqs)
        assert got.shape == want.shape and got.dtype == torch.float32
        assert (got - want).abs().max() < 2e-4 * want.abs().max()
    assert kv.allocator.length("a") == ref_kv.allocator.length("a") == 41


def _decode_after(step, model, batch: bool, graphs: bool = False):
    """Sequence b's decode logits after the same prompts, alone or beside a's verification."""
    kv = cache(model, "b", "a")
    step.forward(kv, [SeqInput("b", list(range(5, 15)), 1)])
    step.forward(kv, [SeqInput("a", list(range(30, 36)), 1)])
    if graphs:
        from specd.models.gpu.graphs import StepGraphs

        step.graphs = StepGraphs(step, kv, max_seqs=4, max_rows=12)
    seqs = [SeqInput("b", [7], 1)] + ([SeqInput("a", [8, 9, 10], 3)] if batch else [])
    out = step.forward(kv, seqs)[0]
    step.graphs = None
    return out


def test_a_row_is_the_same_bits_alone_in_a_batch_and_from_a_graph(triton_ops, models):
    model = models["llama"]
    step = gpu_step(model)
    alone = _decode_after(step, model, batch=False)
    assert torch.equal(alone, _decode_after(step, model, batch=True))
    assert torch.equal(alone, _decode_after(step, model, batch=False, graphs=True))
    assert torch.equal(alone, _decode_after(step, model, batch=True, graphs=True))


def test_an_eager_step_runs_the_head_over_the_rows_it_wants_only(triton_ops, models):
    """A prefill chunk wants its last row's logits or none: the head (the largest matrix,
    read again for each tile of rows) runs over those rows, and a row comes out the same
    bits as from a graph, which runs the head over every row."""
    from specd.models.gpu.graphs import StepGraphs

    model = models["qwen2"]
    step = gpu_step(model)
    head_rows = []
    linear = step.linear

    def counting(x, w, b=None, out=None):
        if w is model.lm_head:
            head_rows.append(x.shape[0])
        return linear(x, w, b, out)

    step.linear = counting
    kv = cache(model, "a", "b")
    chunk = step.forward(kv, [SeqInput("a", list(range(3, 23)), num_logits=0)])
    assert chunk.shape == (0, model.lm_head.shape[0]) and head_rows == []
    step.forward(kv, [SeqInput("b", list(range(40, 50)), 1)])
    assert head_rows == [4]  # 10 rows in 3 tiles of 4; the head reads 1 row in 1 tile
    # b's decode row beside a's last chunk, eagerly: b's row is second of the head's two;
    # then the same row again alone, replayed from a graph, where it is first
    both = step.forward(kv, [SeqInput("a", list(range(23, 36)), 1), SeqInput("b", [7], 1)])
    assert head_rows[-1] == 4 and both.shape[0] == 2
    step.graphs = StepGraphs(step, kv, max_seqs=2, max_rows=12)
    kv.allocator.truncate_to("b", 10)
    alone = step.forward(kv, [SeqInput("b", [7], 1)])
    assert head_rows[-1] == 4 and torch.equal(alone[0], both[1])


def test_graph_buckets_and_what_replays(triton_ops, models):
    from specd.models.gpu.graphs import StepGraphs, buckets
    from specd.models.gpu.step_inputs import HostRows

    assert buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert buckets(8) == [1, 2, 4, 8]
    model = models["llama"]
    step = gpu_step(model)
    kv = cache(model, "a", "b", "c")
    graphs = StepGraphs(step, kv, max_seqs=2, max_rows=12)
    assert graphs.bucket(3) == 4 and graphs.bucket(9) == 12
    over_rows = HostRows.build(kv.allocator, [SeqInput("a", list(range(13)), 1)])
    assert not graphs.fits(over_rows)  # 13 rows: eager
    kv.allocator.truncate_to("a", 0)
    short = HostRows.build(kv.allocator, [SeqInput("a", [1, 2], 1), SeqInput("b", [3], 1)])
    assert graphs.fits(short)
    over_seqs = HostRows.build(kv.allocator, [SeqInput(s, [4], 1) for s in "abc"])
    assert not graphs.fits(over_seqs)  # three sequences, two tables


def test_padding_rows_write_no_keys_or_values(triton_ops, models):
    from specd.models.gpu.graphs import StepGraphs

    model = models["qwen2"]
    step = gpu_step(model)
    kv = cache(model, "a")
    step.graphs = StepGraphs(step, kv, max_seqs=2, max_rows=12)
    before = [p.clone() for p in (*kv.k, *kv.v)]
    step.forward(kv, [SeqInput("a", [5, 6, 7], 3)])  # 3 rows in the 4-row bucket
    written = kv.allocator.slots("a", 0, 3)
    for old, new in zip(before, (*kv.k, *kv.v), strict=True):
        changed = (old != new).flatten(1).any(1).nonzero().flatten().tolist()
        assert changed == written


def test_greedy_is_the_same_with_speculation_on_and_off(triton_ops, tmp_path_factory):
    """The engine on a target that runs the GPU step (its decode/verification steps from
    the graph buckets), three requests in a batch; the draft model proposes on the CPU
    path. (tests/cuda runs it alone and in a batch, compiled.)"""
    from drafter_service.draft_model import DraftModelProposer

    folder, draft_folder = make_tiny_pair(tmp_path_factory, "gpu-step")
    target = load(folder)
    target.gpu = gpu_step(target, split_keys=512)
    draft = load(draft_folder)
    prompts = [[5, 6, 7, 8, 9, 10, 5, 6, 7], [20, 31, 42, 53, 64], [3, 3, 11, 12, 13, 11, 12]]
    reqs = [dict(prompt=p, max_new_tokens=12) for p in prompts]
    config = EngineConfig(
        num_blocks=96, block_size=4, max_batch_size=4, max_draft_tokens=3, max_tree_tokens=0
    )
    off = run_engine(Engine(target, config, None, eos_ids=set()), reqs)
    proposer = DraftModelProposer(draft, num_blocks=96, block_size=4)
    engine = Engine(target, config, proposer, eos_ids=set())
    assert target.gpu.graphs is not None and target.gpu.graphs.kv is engine.kv
    on = run_engine(engine, [dict(r, num_draft=3) for r in reqs])
    assert 0 < engine.totals.accepted < engine.totals.drafted  # drafts taken and refused
    assert list(on.values()) == list(off.values())
    assert engine.kv.allocator.num_used == 0


def test_enforce_eager_captures_no_graphs_and_decodes_the_same(triton_ops, tmp_path_factory):
    """vLLM's --enforce-eager: the engine and the draft model leave their steps eager, no
    graph buckets made, and the output is the graphs' token for token."""
    from dataclasses import replace

    from drafter_service.draft_model import DraftModelProposer

    folder, draft_folder = make_tiny_pair(tmp_path_factory, "gpu-eager")
    target, draft = load(folder), load(draft_folder)
    target.gpu, draft.gpu = gpu_step(target, split_keys=512), gpu_step(draft)
    reqs = [
        dict(prompt=[5, 6, 7, 8, 9, 10, 5, 6, 7], max_new_tokens=6),
        dict(prompt=[3, 4], max_new_tokens=3),
    ]
    config = EngineConfig(num_blocks=96, block_size=4, max_batch_size=4, max_tree_tokens=0)
    graphed = run_engine(Engine(target, config, None, eos_ids=set()), reqs)
    assert target.gpu.graphs is not None
    target.gpu.graphs = None
    eager = Engine(target, replace(config, enforce_eager=True), None, eos_ids=set())
    assert target.gpu.graphs is None
    assert list(run_engine(eager, reqs).values()) == list(graphed.values())
    DraftModelProposer(draft, num_blocks=32, block_size=4, graphs=False)
    assert draft.gpu.graphs is None
    DraftModelProposer(draft, num_blocks=32, block_size=4)
    assert draft.gpu.graphs is not None
