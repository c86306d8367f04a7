"""The prompt's log-probabilities (SamplingParams.prompt_logprobs, the completions API's
`echo` with `logprobs`): each prompt token's after the first, given those before it,
checked against one forward over the prompt; whole though its prompt is cached already or
computed in chunks, the same with speculation on, once though its sequence is preempted."""

from types import SimpleNamespace

import pytest
import torch

from specd.config import EngineConfig
from specd.params import SamplingParams
from tests.unit.test_engine import PROMPTS, make_engine
from tests.unit.test_logprobs import TOP, assert_rank, reference
from verifier_service import logprobs
from verifier_service.engine import Engine
from verifier_service.request import Request


def run(engine, requests: list[dict]) -> list[tuple[list[int], list | None, int]]:
    """Each request's tokens, its prompt log-probabilities (as handed out with its first
    token) and how many of its outputs carried some, in the requests' order."""
    ids = [engine.add_request(Request(**r)) for r in requests]
    tokens = {i: [] for i in ids}
    prompt = {i: None for i in ids}
    carried = dict.fromkeys(ids, 0)
    while engine.has_work():
        for o in engine.step():
            tokens[o.seq_id] += o.tokens
            if o.prompt_logprobs is not None:
                prompt[o.seq_id] = o.prompt_logprobs
                carried[o.seq_id] += 1
    return [(tokens[i], prompt[i], carried[i]) for i in ids]


def asking(prompt, **kw) -> dict:
    params = SamplingParams(prompt_logprobs=TOP)
    return dict(prompt=prompt, max_new_tokens=6, params=params, ignore_eos=True, **kw)


def check(model, prompt: list[int], got) -> None:
    """`got`: a TokenLogprob per prompt token after the first, as one forward gives them
    (to rounding: a chunk's rows come from forwards of other shapes than the reference's;
    a row off by one position is off by nats)."""
    ref = reference(model, prompt[:1], prompt[1:])  # row i: token i + 1's distribution
    assert len(got) == len(prompt) - 1
    want = ref.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    assert torch.allclose(torch.tensor([lp.logprob for lp in got]), want, atol=1e-3)
    for row, lp, token in zip(ref, got, prompt[1:], strict=True):
        assert_rank(row, token, lp.rank, 1e-3)
        assert torch.allclose(torch.tensor(lp.top_logprobs), row.topk(TOP).values, atol=1e-3)
        assert torch.allclose(row[lp.top_ids], torch.tensor(lp.top_logprobs), atol=1e-3)


@pytest.mark.parametrize("chunk", [512, 12])  # a prompt in one forward, or in chunks
def test_a_prompts_logprobs_are_one_forwards_even_where_the_prefix_is_cached(tiny_pair, chunk):
    target, _ = tiny_pair
    engine = make_engine(tiny_pair, max_batched_tokens=chunk, prefix_cache="on", max_draft_tokens=8)
    prompt = PROMPTS[3]  # 50 tokens
    plain = run(engine, [dict(prompt=prompt, max_new_tokens=6, ignore_eos=True)])
    assert plain[0][1] is None and engine.load().prefix_hits == 0  # not asked: none
    # the same prompt again, now in the prefix cache, and a second request beside it
    (tokens, got, carried), other = run(engine, [asking(prompt), asking(PROMPTS[1])])
    assert tokens == plain[0][0] and carried == 1
    check(target, prompt, got)
    check(target, PROMPTS[1], other[1])
    assert engine.kv.allocator.num_used == 0


def test_the_same_with_speculation_on(tiny_pair):
    reqs = [asking(p) for p in PROMPTS[:3]]
    off = run(make_engine(tiny_pair), reqs)
    on = run(make_engine(tiny_pair, "draft"), [dict(r, num_draft=4) for r in reqs])
    for (tokens, got, _), (tokens_on, got_on, _) in zip(off, on, strict=True):
        assert tokens_on == tokens and got_on == got


def test_a_preempted_sequence_hands_its_prompts_logprobs_out_once(tiny_pair):
    """A pool too small for every request at once: sequences are preempted and their
    prompts computed again, their log-probabilities not read twice."""
    target, _ = tiny_pair
    reqs = [dict(asking(p), max_new_tokens=30) for p in PROMPTS]
    small = Engine(target, EngineConfig(num_blocks=40, block_size=4), eos_ids=set())
    got = run(small, reqs)
    assert small.scheduler.preemptions > 0
    for req, (_, prompt_logprobs, carried) in zip(reqs, got, strict=True):
        assert carried == 1
        check(target, req["prompt"], prompt_logprobs)
    assert small.kv.allocator.num_used == 0


def test_rows_read_before_a_preemption_are_not_read_again():
    """A sequence preempted mid-prompt computes its prompt again from the start: the rows
    of the chunks read before are skipped, the rest read on."""
    seq = SimpleNamespace(
        prompt=list(range(10)), prompt_logprobs=[], params=SamplingParams(prompt_logprobs=2)
    )
    rows = torch.randn(10, 16)
    logprobs.prompt_rows(seq, rows[:4], 0)  # the first chunk, then a preemption
    logprobs.prompt_rows(seq, rows[:6], 0)  # computed again, a longer chunk
    logprobs.prompt_rows(seq, rows[6:], 6)  # the last chunk: its last row samples
    assert seq.prompt_logprobs == logprobs.of_rows(rows[:9], seq.prompt[1:], 2)
