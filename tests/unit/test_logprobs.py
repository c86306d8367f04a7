"""Each token's log-probability (SamplingParams.logprobs): the target's raw
log-probability at the position the token was chosen, whichever round chose it (a plain
step, a chain's accepted draft, a tree's branch, a rejection sampler's recovered token),
checked against one forward over the prompt and the output."""

import pytest
import torch

from specd.config import EngineConfig
from specd.models.paged_kv import PagedKV
from specd.models.seq_input import SeqInput
from specd.params import SamplingParams
from tests.conftest import run_engine_logprobs
from tests.unit.test_engine import PROMPTS, make_engine
from tests.unit.test_engine_oracle import OracleProposer, greedy_answers
from verifier_service.engine import Engine
from verifier_service.logprobs import of_rows
from verifier_service.request import Request

TOP = 4


def reference(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """log_softmax of the target's logits at each output position, from one forward over
    prompt + output (a prefill: no speculation, no decode step)."""
    kv = PagedKV.for_model(model, num_blocks=256, block_size=4)
    kv.allocator.allocate("ref")
    ids = prompt + output
    logits = model.forward(kv, [SeqInput("ref", ids[:-1], num_logits=len(output))])
    return torch.log_softmax(logits.float(), dim=-1).cpu()


def assert_rank(row: torch.Tensor, token: int, rank: int, atol: float) -> None:
    """`rank`: how many tokens of `row` are at least as likely as `token`, itself
    included, to the tolerance of rows computed by forwards of other shapes."""
    value = row[token]
    assert int((row > value + atol).sum()) + 1 <= rank <= int((row >= value - atol).sum())


def check(model, prompt, tokens, logprobs) -> None:
    ref = reference(model, prompt, tokens)
    got = torch.tensor([lp.logprob for lp in logprobs])
    want = ref.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    for row, lp, token in zip(ref, logprobs, tokens, strict=True):
        assert_rank(row, token, lp.rank, 1e-4)
        assert len(lp.top_ids) == TOP
        assert lp.top_logprobs == sorted(lp.top_logprobs, reverse=True)
        assert torch.allclose(torch.tensor(lp.top_logprobs), row.topk(TOP).values, atol=1e-4)
        assert torch.allclose(row[lp.top_ids], torch.tensor(lp.top_logprobs), atol=1e-4)


def test_a_tokens_rank_counts_those_at_least_as_likely():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0, 2.0], [5.0, 0.0, 0.0, 0.0, 0.0]])
    got = of_rows(logits, [2, 0], top=2)
    assert [lp.rank for lp in got] == [4, 1]  # a tie ranks both tokens by the count
    assert [lp.top_ids for lp in got][0] in ([1, 3], [3, 1])
    assert [lp.rank for lp in of_rows(logits, [3, 4], top=0)] == [2, 5]


def greedy(prompt, **kw) -> dict:
    params = SamplingParams(logprobs=TOP)
    return dict(prompt=prompt, max_new_tokens=20, params=params, ignore_eos=True, **kw)


@pytest.mark.parametrize("proposer", [None, "draft", "ngram"])
def test_greedy_logprobs_are_the_targets_and_the_same_with_speculation_on(tiny_pair, proposer):
    target, _ = tiny_pair
    reqs = [greedy(p) for p in PROMPTS[:2]]
    off = run_engine_logprobs(make_engine(tiny_pair), reqs)
    on = run_engine_logprobs(make_engine(tiny_pair, proposer), [dict(r, num_draft=4) for r in reqs])
    for req, (tokens, logprobs), (tokens_on, logprobs_on) in zip(reqs, off, on, strict=True):
        assert tokens_on == tokens
        check(target, req["prompt"], tokens, logprobs)
        assert [lp.top_ids[0] for lp in logprobs] == tokens  # greedy: the most likely
        assert logprobs_on == logprobs  # batch-invariant rows: the same values, bit for bit


@pytest.mark.parametrize("wrong_at", [0, 2])
def test_a_trees_branch_taken_every_round_reads_the_branchs_rows(tiny_pair, wrong_at):
    """Every round's chain is wrong at `wrong_at` and the alternative beside it right, so
    the tokens after the branch come from the alternatives' rows, not the chain's."""
    target, _ = tiny_pair
    reqs = [greedy(p) for p in PROMPTS[:2]]
    answers = greedy_answers(tiny_pair, [dict(r, params=SamplingParams()) for r in reqs])
    proposer = OracleProposer(answers, target.args.vocab_size, wrong_at=wrong_at)
    engine = Engine(target, EngineConfig(num_blocks=256, block_size=4), proposer, eos_ids=set())
    outputs = run_engine_logprobs(engine, [dict(r, num_draft=4) for r in reqs])
    for req, (tokens, logprobs) in zip(reqs, outputs, strict=True):
        assert tokens == answers[tuple(req["prompt"])]
        check(target, req["prompt"], tokens, logprobs)
    assert engine.totals.accepted >= (wrong_at + 1) * 4  # the branches were taken


def test_sampled_tokens_get_their_raw_logprob_not_the_tempered_one(tiny_pair):
    """At temperature 2 with a draft model (accepted drafts, recovered and bonus tokens),
    each token's log-probability is the target's own at temperature 1, as vLLM returns it."""
    target, _ = tiny_pair
    params = SamplingParams(temperature=2.0, top_k=50, seed=7, logprobs=TOP)
    req = dict(prompt=PROMPTS[0], max_new_tokens=30, params=params, ignore_eos=True)
    engine = make_engine(tiny_pair, "draft")
    [(tokens, logprobs)] = run_engine_logprobs(engine, [dict(req, num_draft=3)])
    check(target, PROMPTS[0], tokens, logprobs)
    assert engine.totals.accepted > 0
    assert any(lp.top_ids[0] != t for t, lp in zip(tokens, logprobs, strict=True))


def test_no_logprobs_unless_asked(tiny_pair):
    engine = make_engine(tiny_pair, "draft")
    engine.add_request(Request(PROMPTS[0], max_new_tokens=8, num_draft=3))
    while engine.has_work():
        assert all(o.logprobs is None for o in engine.step())


def test_a_biased_requests_logprobs_are_the_raw_ones(tiny_pair):
    """A logit bias bans the plain answer's first token: the output changes, its logprobs
    are still the target's raw ones (the banned token leads the first row)."""
    target, _ = tiny_pair
    [(plain, _)] = run_engine_logprobs(make_engine(tiny_pair), [greedy(PROMPTS[0])])
    params = SamplingParams(logprobs=TOP, logit_bias=((plain[0], -100.0),))
    req = dict(greedy(PROMPTS[0]), params=params, num_draft=3)
    [(tokens, logprobs)] = run_engine_logprobs(make_engine(tiny_pair, "draft"), [req])
    check(target, PROMPTS[0], tokens, logprobs)
    assert tokens[0] != plain[0] and logprobs[0].top_ids[0] == plain[0]
