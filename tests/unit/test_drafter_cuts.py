"""The drafter's cost cuts: int8/int4 weights and a trimmed head (exactness never depends
on the drafter, so the checks are: close logits, restricted support, unchanged outputs)."""

import copy

import pytest
import torch

from drafter_service.draft_model import DraftModelProposer
from specd.config import EngineConfig
from specd.models.catalog import DEFAULT_DRAFT
from specd.models.loader import load_model
from specd.models.paged_kv import PagedKV
from specd.models.seq_input import SeqInput
from specd.params import SamplingParams
from specd.proposal import DraftState
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


def test_trimmed_head_proposes_only_kept_tokens_and_keeps_parity(tiny_pair):
    target, draft = tiny_pair
    small = copy.copy(draft)
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
@pytest.mark.parametrize("fmt,min_cos,agree", [("int8", 0.99, 0.9), ("int4", 0.93, 0.75)])
def test_real_quantised_drafter_tracks_its_dense_logits(cpu_kernels, fmt, min_cos, agree):
    folder = real_model_or_skip(DEFAULT_DRAFT)
    ids = list(range(1000, 1064))
    # this CPU's default activations (bf16 dense is slow where it has no bf16 hardware)
    exact = prefill_logits(load_model(folder, device="cpu", weights="bf16"), ids)
    model = load_model(folder, device="cpu", weights=fmt)
    assert model.weights == fmt  # quantised, not bf16 against itself
    approx = prefill_logits(model, ids, one_by_one_from=48)  # the last 16 as draft steps
    cos = torch.nn.functional.cosine_similarity(approx, exact, dim=-1)
    assert cos.min() > min_cos
    assert (approx.argmax(-1) == exact.argmax(-1)).float().mean() >= agree
