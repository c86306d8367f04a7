"""The real default pair in a default configuration (batch-invariant shapes, alternatives,
rounds stopped by the drafter's p_min), once per quantised weight format: greedy output
with speculation is token for token the output without it, on code and chat prompts.
int4 (the default format) runs at this CPU's default activations (bf16 with AVX512-BF16
or AMX, fp32 with an fp16 K/V cache otherwise); int8 at fp32, so that an AVX512-BF16 host
checks both activation defaults, and an AVX2 host runs no slow bf16. One engine serves both
runs, as a verifier serves a request with speculation off beside others with it on; the
prefix cache (on by default in this configuration) gives the second run its prompts. The
tokens' log-probabilities are the same too, value for value."""

import pytest
import torch

from bench.prompts import load_workload
from drafter_service.draft_model import DraftModelProposer
from specd.config import DrafterConfig, EngineConfig
from specd.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET
from specd.models.loader import load_model, load_tokenizer
from specd.params import SamplingParams
from tests.conftest import real_model_or_skip, run_engine_logprobs
from verifier_service.engine import Engine


@pytest.mark.real
@pytest.mark.parametrize("fmt,dtype,tokens", [("int4", "auto", 64), ("int8", "fp32", 32)])
def test_real_pair_greedy_identical_on_and_off(cpu_kernels, fmt, dtype, tokens):
    target_dir = real_model_or_skip(DEFAULT_TARGET)
    draft_dir = real_model_or_skip(DEFAULT_DRAFT)
    tok = load_tokenizer(target_dir)
    prompts = load_workload("code", tok, limit=3) + load_workload("chat", tok, limit=3)
    target = load_model(target_dir, dtype=dtype, device="cpu", weights=fmt)
    draft = load_model(draft_dir, dtype=dtype, device="cpu", weights=fmt)
    assert target.weights == fmt and target.chunk_invariant()
    if target.dtype == torch.float32:
        assert target.kv_dtype == torch.float16
    params = SamplingParams(logprobs=2)  # the target's log-probabilities come back too
    reqs = [dict(prompt=p, max_new_tokens=tokens, ignore_eos=True, params=params) for p in prompts]
    proposer = DraftModelProposer(draft, num_blocks=256, alternatives=4, p_min=DrafterConfig.p_min)
    engine = Engine(target, EngineConfig(), proposer)
    off = run_engine_logprobs(engine, reqs)  # num_draft 0: plain decoding beside a drafter
    assert engine.totals.rounds == 0 and proposer.kv.allocator.num_used == 0
    on = run_engine_logprobs(engine, [dict(r, num_draft=5) for r in reqs])
    assert engine.kv.allocator.cached_tokens > 0  # the prompts came from the prefix cache
    diverged = [i for i, (a, b) in enumerate(zip(on, off, strict=True)) if a[0] != b[0]]
    assert not diverged, f"prompts {diverged} diverged"
    # the same rows, whichever forward computed them: the same values, bit for bit
    assert [lp for _, lps in on for lp in lps] == [lp for _, lps in off for lp in lps]
    assert engine.totals.accepted > 0 and proposer.cut_rounds > 0
    assert engine.kv.allocator.num_used == 0
