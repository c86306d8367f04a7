"""The drafter's cost cuts: int8 weights and a trimmed head (exactness never depends on
the drafter, so the checks are: close logits, restricted support, unchanged outputs)."""

import copy

import pytest
import torch

from drafter_service.draft_model import DraftModelProposer
from drafter_service.proposer import DraftState
from specd.config import EngineConfig
from specd.models.catalog import DEFAULT_DRAFT
from specd.models.loader import load_model
from specd.models.paged_kv import PagedKV, SeqInput
from specd.models.quant import int8_linear, pack_for_cpu, quantize_int8, quantize_model_int8
from specd.sampling import SamplingParams
from tests.conftest import real_model_or_skip, run_engine
from verifier_service.engine import Engine

PROMPT = [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 40, 41, 42]


def prefill_logits(model, ids, one_by_one_from: int | None = None):
    """Logits at every position; from `one_by_one_from` on, fed a token per forward (the
    drafter's one-row steps)."""
    kv = PagedKV.for_model(model, num_blocks=64, block_size=4)
    kv.allocator.allocate(0)
    split = len(ids) if one_by_one_from is None else one_by_one_from
    rows = [model.forward(kv, [SeqInput(0, ids[:split], num_logits=split)])]
    rows += [model.forward(kv, [SeqInput(0, [t])]) for t in ids[split:]]
    return torch.cat(rows)


def test_int8_roundtrip_error_is_per_channel_bounded():
    w = torch.randn(64, 48) * torch.linspace(0.1, 3.0, 64)[:, None]
    q = quantize_int8(w)
    err = (q.dequantize(torch.float32) - w).abs()
    assert (err <= q.scales[:, None] / 2 + 1e-6).all()  # half a step per channel


def test_fbgemm_packed_int8_matches_the_weight_only_kernel():
    torch.manual_seed(0)
    w = quantize_int8(torch.randn(256, 128) * 0.05)
    packed = pack_for_cpu(w)
    if "fbgemm" in torch.backends.quantized.supported_engines:
        assert packed.packed is not None
    for rows in (1, 3, 17):  # a few rows: fbgemm; more: the weight-only kernel
        x = torch.randn(rows, 128)
        exact = x @ w.dequantize(torch.float32).t()
        got = int8_linear(x, packed)  # activations quantised per call: ~1% error
        assert got.shape == exact.shape
        assert (got - exact).abs().max() <= 0.02 * exact.abs().max()


# weight-only int8, and fbgemm's packed kernel for one-row steps, which also quantises the
# activations (7-bit): looser; what it costs in acceptance is measured (BENCHMARKS.md)
@pytest.mark.parametrize("pack,max_err,agree", [(False, 0.05, 0.9), (True, 0.12, 0.8)])
def test_int8_drafter_logits_close(tiny_pair, pack, max_err, agree):
    _, draft = tiny_pair
    exact = prefill_logits(draft, PROMPT)
    q = copy.copy(draft)
    q.layers = [copy.copy(layer) for layer in draft.layers]
    quantize_model_int8(q, pack=pack)
    approx = prefill_logits(q, PROMPT, one_by_one_from=4)
    assert (approx - exact).abs().max() <= max_err * exact.abs().max()
    assert torch.nn.functional.cosine_similarity(approx, exact, dim=-1).min() > 0.98
    assert (approx.argmax(-1) == exact.argmax(-1)).float().mean() >= agree


def test_trimmed_head_proposes_only_kept_tokens_and_keeps_parity(tiny_pair):
    target, draft = tiny_pair
    small = copy.copy(draft)
    small.layers = [copy.copy(layer) for layer in draft.layers]
    quantize_model_int8(small)
    keep = torch.arange(0, 96, 2)  # even token ids only
    small.trim_head(keep)
    proposer = DraftModelProposer(small, num_blocks=64, block_size=4)
    for params in (SamplingParams(), SamplingParams(temperature=1.0, seed=3)):
        p = proposer.propose([DraftState("s", PROMPT, params, 4)])[0]
        assert len(p.tokens) == 4 and all(t % 2 == 0 for t in p.tokens)
        if p.q_ids is not None:
            assert (p.q_ids % 2 == 0).all()
        proposer.close("s")
    reqs = [dict(prompt=PROMPT, max_new_tokens=24), dict(prompt=PROMPT[3:], max_new_tokens=20)]
    cfg = EngineConfig(num_blocks=128, block_size=4)
    off = run_engine(Engine(target, cfg), reqs)
    engine = Engine(target, cfg, proposer)
    on = run_engine(engine, [dict(r, num_draft=3) for r in reqs])
    assert list(on.values()) == list(off.values())
    assert engine.totals.drafted > 0


@pytest.mark.real
def test_real_int8_drafter_tracks_its_bf16_logits():
    folder = real_model_or_skip(DEFAULT_DRAFT)
    model = load_model(folder, dtype="bf16", device="cpu")
    ids = list(range(1000, 1064))
    exact = prefill_logits(model, ids)
    quantize_model_int8(model)
    approx = prefill_logits(model, ids, one_by_one_from=48)  # the last 16 as draft steps
    cos = torch.nn.functional.cosine_similarity(approx, exact, dim=-1)
    assert cos.min() > 0.98
    assert (approx.argmax(-1) == exact.argmax(-1)).float().mean() >= 0.85
