"""The real default pair (Qwen2.5-Coder 0.5B drafting for 1.5B): greedy parity in fp32."""

import pytest

from bench.prompts import load_workload
from drafter_service.draft_model import DraftModelProposer
from drafter_service.ngram import NgramProposer
from specd.config import EngineConfig
from specd.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET
from specd.models.loader import load_model, load_tokenizer
from tests.conftest import real_model_or_skip, run_engine
from verifier_service.engine import Engine


@pytest.fixture(scope="module")
def real_pair():
    target_dir = real_model_or_skip(DEFAULT_TARGET)
    draft_dir = real_model_or_skip(DEFAULT_DRAFT)
    tok = load_tokenizer(target_dir)
    prompts = load_workload("code", tok, limit=2) + load_workload("chat", tok, limit=2)
    target = load_model(target_dir, dtype="fp32", device="cpu")
    draft = load_model(draft_dir, dtype="fp32", device="cpu")
    reqs = [dict(prompt=p, max_new_tokens=40, ignore_eos=True) for p in prompts]
    off = run_engine(Engine(target, EngineConfig()), reqs)
    return target, draft, reqs, list(off.values())


@pytest.mark.real
@pytest.mark.parametrize("kind,k", [("draft", 1), ("draft", 5), ("ngram", 3), ("alternatives", 4)])
def test_real_pair_greedy_parity_fp32(real_pair, kind, k):
    target, draft, reqs, off = real_pair
    if kind == "ngram":
        proposer = NgramProposer()
    else:  # "alternatives": the runner-up beside each draft, tree verification
        proposer = DraftModelProposer(draft, num_blocks=256, alternatives=k * (kind != "draft"))
    engine = Engine(target, EngineConfig(), proposer)
    on = run_engine(engine, [dict(r, num_draft=k) for r in reqs])
    assert list(on.values()) == off
    assert engine.totals.accepted > 0
    assert engine.kv.allocator.num_used == 0
    if kind == "alternatives":
        assert engine.branches_taken > 0
