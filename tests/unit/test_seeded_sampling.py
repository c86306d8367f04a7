"""Sampling with a seed: a request's output follows its seed alone, with speculation
off, on and auto, chain, tree or lookup (verifier_service/verify.py `_seeded`); the draft
model drafts with the verifier's draws; a server's --seed seeds the requests that name
none."""

import pytest

from drafter_service.draft_model import DraftModelProposer
from specd.config import EngineConfig
from specd.params import SamplingParams
from tests.conftest import run_engine
from tests.unit.test_engine import PROMPTS, make_engine
from verifier_service.engine import Engine


def test_sampled_generation_is_seeded_and_frees_everything(tiny_pair):
    engine = make_engine(tiny_pair, "draft")
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=11)
    reqs = [dict(prompt=p, params=params, max_new_tokens=16, num_draft=3) for p in PROMPTS]
    a = run_engine(engine, reqs)
    b = run_engine(engine, reqs)
    assert list(a.values()) == list(b.values())
    assert engine.kv.allocator.num_used == 0 and engine.proposer.kv.allocator.num_used == 0


@pytest.mark.parametrize("kind", ["draft", "ngram", "combined"])
def test_a_seeded_sampled_request_emits_the_same_drafted_or_not(tiny_pair, kind):
    """A seeded sampled request's tokens are its seed's at each position: the same token
    for token with speculation off and on, at any k, chain or tree, alone or in a batch
    (its drafts decide only how many are taken a round)."""
    samplers = (dict(temperature=1.0), dict(temperature=0.8, top_p=0.9), dict(temperature=1.5))
    reqs = [
        dict(prompt=p, params=SamplingParams(seed=40 + i, **samplers[i % 3]), max_new_tokens=20)
        for i, p in enumerate(PROMPTS)
    ]
    off = list(run_engine(make_engine(tiny_pair), reqs).values())
    assert len({tuple(o) for o in off}) == len(off)
    for k in (1, 4):
        engine = make_engine(tiny_pair, kind, max_tree_tokens=16)
        on = run_engine(engine, [dict(r, num_draft=k) for r in reqs])
        assert list(on.values()) == off, (kind, k)
        assert engine.totals.drafted > 0
        if kind != "ngram":  # a lookup in sampled text rarely finds the token drawn
            assert 0 < engine.totals.accepted < engine.totals.drafted, engine.totals
    alone = run_engine(make_engine(tiny_pair, kind), [dict(reqs[1], num_draft=3)])
    assert list(alone.values()) == [off[1]]


def test_a_seeded_sampled_request_emits_the_same_with_alternative_leaves(tiny_pair):
    """As above with a tree: the draft model's runner-up beside its drafts, verified in the
    same forward (a seeded request's rounds may now have leaves)."""
    target, draft = tiny_pair
    reqs = [
        dict(prompt=p, params=SamplingParams(temperature=0.7, seed=60 + i), max_new_tokens=20)
        for i, p in enumerate(PROMPTS)
    ]
    off = list(run_engine(make_engine(tiny_pair), reqs).values())
    proposer = DraftModelProposer(draft, num_blocks=128, block_size=4, alternatives=3)
    cfg = EngineConfig(num_blocks=256, block_size=4, max_tree_tokens=256, cost_model=False)
    tree = Engine(target, cfg, proposer, eos_ids=set())
    on = run_engine(tree, [dict(r, num_draft=3) for r in reqs])
    assert list(on.values()) == off
    assert tree.tree_rounds > 0  # leaves were verified (one taken: test_verify_penalties)


def test_a_drafter_drafts_a_seeded_request_with_the_verifiers_draws(tiny_pair):
    """The draft model drafts a seeded sampled request with the draws the verifier takes
    its tokens with: drafting with the target's own weights, every draft is taken, where
    drafts drawn apart would agree with the target's at ~1 position in 3 (a sampled 96-token
    vocabulary)."""
    target, _ = tiny_pair
    proposer = DraftModelProposer(target, num_blocks=128, block_size=4, top_m=96)
    engine = Engine(target, EngineConfig(num_blocks=256, block_size=4), proposer, set())
    params = SamplingParams(temperature=1.0, seed=9)
    run_engine(
        engine, [dict(prompt=p, params=params, max_new_tokens=24, num_draft=4) for p in PROMPTS]
    )
    assert engine.totals.drafted > 60
    assert engine.totals.accepted >= 0.97 * engine.totals.drafted, engine.totals


def test_a_servers_seed_seeds_the_requests_that_name_none(tiny_pair):
    """vLLM's --seed: unseeded sampled requests, the same in the same order at the same k,
    sample the same on two engines started from one seed, and otherwise on another seed; a
    greedy request among them takes no seed of the sequence."""
    params = SamplingParams(temperature=1.0)
    reqs = [dict(prompt=p, params=params, max_new_tokens=16, num_draft=3) for p in PROMPTS]
    greedy = dict(prompt=PROMPTS[1], max_new_tokens=4)

    def outputs(seed, first=()):
        engine = make_engine(tiny_pair, "draft", seed=seed)
        run_engine(engine, list(first))
        return list(run_engine(engine, reqs).values())

    a = outputs(7)
    assert outputs(7, [greedy]) == a
    assert outputs(8) != a
    assert outputs(-1) != outputs(-1)  # no seed: each request its own random one
