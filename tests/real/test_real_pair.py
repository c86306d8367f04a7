"""The real default pair (Qwen2.5-Coder 0.5B drafting for 1.5B): greedy parity in fp32
with the target's dense weights (`--weights bf16` where the CPU has no bf16 arithmetic).

Its decode and verification steps run the dense fp32 kernel (specd.models.matmul,
kernels/dense_linear.cpp) over the checkpoint's bf16 matrices, kept bf16 in memory and
widened in registers; it sums each row in one order whatever rows share the call, and
tests/unit/test_matmul.py checks that bit for bit. One run with speculation, as for every
other format (test_real_formats): the draft model with its runner-up alternatives (tree
verification), a different k per request, so that verification rows of every width share
the batch and the forward's row count moves from 4 to past 16; the leaves forced, not
priced. The draft model runs the drafter's default weights (int4 where the CPU kernels
run): what it proposes does not change what parity means, and an unquantised fp32 draft
took a third of the test. The proposers and each k alone are checked on the tiny pair
(test_engine)."""

import pytest
import torch

from bench.prompts import load_workload
from drafter_service.draft_model import DraftModelProposer
from specd.config import EngineConfig
from specd.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET
from specd.models.loader import load_model, load_tokenizer
from tests.conftest import real_model_or_skip, run_engine
from verifier_service.engine import Engine

KS = (1, 5, 3, 4)  # one per request: 2 + 6 + 4 + 5 rows with no alternative


@pytest.mark.real
def test_real_pair_greedy_parity_fp32():
    target_dir = real_model_or_skip(DEFAULT_TARGET)
    draft_dir = real_model_or_skip(DEFAULT_DRAFT)
    tok = load_tokenizer(target_dir)
    prompts = load_workload("code", tok, limit=2) + load_workload("chat", tok, limit=2)
    target = load_model(target_dir, dtype="fp32", device="cpu")
    assert target.lm_head.dtype == target.layers[0].w_down.dtype == torch.bfloat16
    draft = load_model(draft_dir, dtype="fp32", device="cpu", weights="auto")
    reqs = [dict(prompt=p, max_new_tokens=40, ignore_eos=True) for p in prompts]
    off = run_engine(Engine(target, EngineConfig()), reqs)
    proposer = DraftModelProposer(draft, num_blocks=256, alternatives=4)
    # the leaves forced (no cost model: every step's tree room filled), not left to what
    # this machine measures rows to cost; k is each request's own either way
    engine = Engine(target, EngineConfig(cost_model=False), proposer)
    on = run_engine(engine, [dict(r, num_draft=k) for r, k in zip(reqs, KS, strict=True)])
    diverged = [i for i, (a, b) in enumerate(zip(on.values(), off.values(), strict=True)) if a != b]
    assert not diverged, f"prompts {diverged} diverged"
    assert engine.totals.accepted > 0 and engine.branches_taken > 0
    assert engine.kv.allocator.num_used == 0
