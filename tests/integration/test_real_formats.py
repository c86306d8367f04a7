"""The real default pair in the default configuration (bf16 activations, batch-invariant
shapes, alternatives, rounds stopped by the drafter's p_min) for each quantised weight
format: greedy output with speculation is token for token the output without it, on code
and chat prompts."""

import pytest

from bench.prompts import load_workload
from drafter_service.draft_model import DraftModelProposer
from specd.config import DrafterConfig, EngineConfig
from specd.models import native
from specd.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET
from specd.models.loader import load_model, load_tokenizer
from tests.conftest import real_model_or_skip, run_engine
from verifier_service.engine import Engine


@pytest.mark.real
@pytest.mark.parametrize("fmt,tokens", [("int4", 64), ("int8", 32)])
def test_real_pair_greedy_identical_on_and_off(fmt, tokens):
    if native.kernel() is None:
        pytest.skip("no int8/int4 kernel on this CPU")
    target_dir = real_model_or_skip(DEFAULT_TARGET)
    draft_dir = real_model_or_skip(DEFAULT_DRAFT)
    tok = load_tokenizer(target_dir)
    prompts = load_workload("code", tok, limit=3) + load_workload("chat", tok, limit=3)
    target = load_model(target_dir, dtype="bf16", device="cpu", weights=fmt)
    draft = load_model(draft_dir, dtype="bf16", device="cpu", weights=fmt)
    reqs = [dict(prompt=p, max_new_tokens=tokens, ignore_eos=True) for p in prompts]
    off = run_engine(Engine(target, EngineConfig()), reqs)
    proposer = DraftModelProposer(draft, num_blocks=256, alternatives=4, p_min=DrafterConfig.p_min)
    engine = Engine(target, EngineConfig(), proposer)
    on = run_engine(engine, [dict(r, num_draft=5) for r in reqs])
    diverged = [i for i, (a, b) in enumerate(zip(on.values(), off.values(), strict=True)) if a != b]
    assert not diverged, f"prompts {diverged} diverged"
    assert engine.totals.accepted > 0 and proposer.cut_rounds > 0
    assert engine.kv.allocator.num_used == 0
