"""The prefix cache in the engine and the drafter: a prompt that starts like an earlier one
computes only its tail, and (int4/int8 with the paged attention kernel: on by default)
every output is the one the full computation gives, token for token, greedy and seeded."""

import pytest
import torch

from drafter_service.draft_model import DraftModelProposer
from specd.config import EngineConfig
from specd.models.loader import load_model
from specd.models.paged_kv import PagedKV
from specd.models.seq_input import SeqInput
from specd.params import SamplingParams
from tests.conftest import make_tiny_pair, run_engine
from verifier_service.engine import Engine
from verifier_service.request import Request

pytestmark = pytest.mark.usefixtures("cpu_kernels")  # fails, not skips, in CI

BLOCK = 4
SYSTEM = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3]  # 18 tokens: 4 full blocks
QUESTIONS = [[40, 41, 42, 43, 44], [50, 51, 52], [60, 61, 62, 63, 64, 65, 66]]


@pytest.fixture(scope="module")
def quantised_pair(tmp_path_factory):
    target_dir, draft_dir = make_tiny_pair(tmp_path_factory, prefix="pc")
    return (
        load_model(target_dir, dtype="bf16", device="cpu", weights="int4"),
        load_model(draft_dir, dtype="bf16", device="cpu", weights="int4"),
    )


def _engine(target, draft=None, **config) -> Engine:
    proposer = None
    if draft is not None:
        proposer = DraftModelProposer(draft, num_blocks=256, block_size=BLOCK, prefix_cache=True)
    cfg = EngineConfig(**{"num_blocks": 256, "block_size": BLOCK, **config})
    return Engine(target, cfg, proposer, eos_ids=set())


def _one_by_one(engine: Engine, requests: list[dict]) -> list[list[int]]:
    """Each request after the previous one finished (so it can find its blocks)."""
    return [next(iter(run_engine(engine, [r]).values())) for r in requests]


def _requests(**extra) -> list[dict]:
    prompts = [SYSTEM + q for q in QUESTIONS] + [SYSTEM + QUESTIONS[0]]  # the last: a repeat
    return [dict(prompt=p, max_new_tokens=24, **extra) for p in prompts]


def test_auto_is_on_where_the_forward_is_chunk_invariant(quantised_pair, tiny_pair):
    assert quantised_pair[0].chunk_invariant()
    assert _engine(quantised_pair[0]).kv.allocator.prefix_cache
    dense = tiny_pair[0]  # fp32 weights: rows after a cached prefix could round otherwise
    assert not dense.chunk_invariant()
    assert not _engine(dense).kv.allocator.prefix_cache
    assert _engine(dense, prefix_cache="on").kv.allocator.prefix_cache
    assert not _engine(quantised_pair[0], prefix_cache="off").kv.allocator.prefix_cache


@pytest.mark.parametrize("length,split", [(25, 4), (25, 8), (25, 13), (25, 21), (100, 30)])
def test_a_prompt_split_anywhere_gives_the_same_logits(quantised_pair, length, split):
    """What the cache rests on: the logits after a prompt (and after decode steps on it)
    are bitwise those of one forward, however the prompt was cut into forwards (a chunk of
    more than attention.MAX_ROWS tokens too)."""
    target, _ = quantised_pair
    prompt = ((SYSTEM + QUESTIONS[2]) * 4)[:length]
    kv = PagedKV.for_model(target, num_blocks=64, block_size=BLOCK)
    kv.allocator.allocate("whole")
    kv.allocator.allocate("split")
    whole = target.forward(kv, [SeqInput("whole", prompt)])
    target.forward(kv, [SeqInput("split", prompt[:split], num_logits=0)])
    cut = target.forward(kv, [SeqInput("split", prompt[split:])])
    assert torch.equal(whole, cut)
    for token in (7, 70, 17):
        whole = target.forward(kv, [SeqInput("whole", [token])])
        cut = target.forward(kv, [SeqInput("split", [token])])
        assert torch.equal(whole, cut)


@pytest.mark.parametrize("num_draft", [0, 4])
def test_a_shared_prefix_is_computed_once_and_changes_no_token(quantised_pair, num_draft):
    target, draft = quantised_pair
    requests = _requests(num_draft=num_draft)
    cold = [next(iter(run_engine(_engine(target, draft, prefix_cache="off"), [r]).values()))
            for r in requests]  # fmt: skip
    engine = _engine(target, draft)
    warm = _one_by_one(engine, requests)
    assert warm == cold
    alloc = engine.kv.allocator
    # the 4 full blocks of the system prompt for the 2nd and 3rd; the repeat finds all of
    # its own prompt's full blocks but the last token's (22 tokens: 5 blocks, 20 tokens)
    assert alloc.cached_tokens == 16 + 16 + 20
    assert alloc.num_used == 0 and alloc.num_free == 256  # cached blocks count as free
    if num_draft:
        assert engine.totals.accepted > 0
        drafter = engine.proposer.kv.allocator
        assert drafter.cached_tokens > 0 and drafter.num_used == 0


def test_seeded_samples_are_the_same_from_the_cache(quantised_pair):
    target, draft = quantised_pair
    requests = _requests(params=SamplingParams(temperature=1.0, seed=11), num_draft=3)
    cold = [next(iter(run_engine(_engine(target, draft, prefix_cache="off"), [r]).values()))
            for r in requests]  # fmt: skip
    assert _one_by_one(_engine(target, draft), requests) == cold


def test_concurrent_requests_share_what_is_published_and_evict_under_pressure(quantised_pair):
    """A pool too small to keep everything: cached blocks give way to new sequences, and
    outputs stay those of the full computation."""
    target, _ = quantised_pair
    g = torch.Generator().manual_seed(0)
    prompts = [SYSTEM + torch.randint(10, 90, (9,), generator=g).tolist() for _ in range(6)]
    requests = [dict(prompt=p, max_new_tokens=12) for p in prompts]
    cold = run_engine(_engine(target, num_blocks=40, prefix_cache="off"), requests)
    engine = _engine(target, num_blocks=40)
    for _ in range(2):  # the second time round, the first wave's blocks are partly evicted
        warm = run_engine(engine, requests)
        assert list(warm.values()) == list(cold.values())
    alloc = engine.kv.allocator
    assert alloc.cached_tokens > 0 and alloc.num_used == 0 and alloc.num_free == 40


def test_the_prompt_hits_a_request_reports_are_its_first_admissions(tiny_pair):
    """A sequence preempted and admitted again finds its own generated tokens cached: the
    prompt tokens it reports found in the prefix cache stay those of its first admission
    (never more than the prompt less its last token)."""
    target, _ = tiny_pair
    engine = Engine(
        target, EngineConfig(num_blocks=24, block_size=4, prefix_cache="on"), eos_ids=set()
    )
    prompt = [5, 17, 3, 42, 8, 60, 11, 29, 71]
    run_engine(engine, [dict(prompt=prompt, max_new_tokens=2)])  # now cached: 8 tokens
    hits = {}
    ids = [engine.add_request(Request(prompt, max_new_tokens=28)) for _ in range(4)]
    while engine.has_work():
        for out in engine.step():
            hits.setdefault(out.seq_id, set()).add(out.prompt_hits)
    assert engine.scheduler.preemptions > 0
    assert [hits[i] for i in ids] == [{8}] * 4


def test_a_salt_keeps_cached_prompts_to_the_requests_of_that_salt(quantised_pair):
    """vLLM's cache_salt, in the verifier's cache and the drafter's: a prompt is found
    again under its own salt only (unsalted ones only unsalted), and changes no token."""
    target, draft = quantised_pair
    prompt = SYSTEM + QUESTIONS[0]  # 23 tokens: 5 full blocks, found but the last token
    engine = _engine(target, draft)
    verifier, drafter = engine.kv.allocator, engine.proposer.kv.allocator
    found, outputs = [], []
    for salt in ("alice", "bob", "", "alice", "bob", ""):
        before = (verifier.cached_tokens, drafter.cached_tokens)
        request = dict(prompt=prompt, max_new_tokens=8, num_draft=3, cache_salt=salt)
        outputs.append(_one_by_one(engine, [request])[0])
        found.append((verifier.cached_tokens - before[0], drafter.cached_tokens - before[1]))
    assert [v for v, _ in found] == [0, 0, 0, 20, 20, 20]
    assert [d > 0 for _, d in found] == [False] * 3 + [True] * 3
    assert all(out == outputs[0] for out in outputs)


def test_a_cache_salt_crosses_router_verifier_and_drafter():
    """An HTTP body's cache_salt reaches the verifier's request and the drafter's session,
    and keeps the response out of a suffix drafter's shared memory; an empty one is 400."""
    from drafter_service.sessions import Sessions
    from protos.specd.v1 import drafter_pb2
    from router.body import BodyError, parse
    from router.decide import Decision
    from router.openai_request import to_request
    from router.openai_schema import CompletionBody
    from router.policy import Policy
    from router.prepare import Prepared
    from router.relay import verifier_request
    from specd.proposal import DraftState
    from verifier_service import server
    from verifier_service.drafter_client import RemoteProposer

    body = parse(b'{"model": "m", "prompt": "ab", "cache_salt": "alice"}', CompletionBody)
    policy = Policy.from_dict({}).for_route("default")[1]
    prep = Prepared(to_request(body), None, [5, 6, 7], "default", [], policy, 8, {}, None)
    wire = verifier_request(prep, Decision(4, True, "auto"))
    assert wire.cache_salt == "alice" and wire.suffix_private
    assert server._request(wire, "default", 4, 8, None, None).cache_salt == "alice"
    remote = RemoteProposer.__new__(RemoteProposer)  # its command building only
    remote._sent, remote._asked, drafted = {}, {}, drafter_pb2.DraftRequest(round=1)
    remote._add_commands(drafted, DraftState(1, [5, 6, 7], SamplingParams(), 4, cache_salt="alice"))
    assert drafted.commands[0].open.cache_salt == "alice"
    sessions = Sessions(96, max_draft_tokens=8)
    steps = sessions.round(0, [*drafted.commands])
    assert [s.state.cache_salt for s in steps] == ["alice"]
    with pytest.raises(BodyError):
        parse(b'{"model": "m", "prompt": "ab", "cache_salt": ""}', CompletionBody)


def test_a_reset_forgets_the_prompts_of_the_verifiers_cache_and_the_drafters(quantised_pair):
    """Engine.reset_prefix_cache, applied before the next step: a repeated prompt finds
    nothing in either cache, then finds itself again, and its tokens never change."""
    target, draft = quantised_pair
    engine = _engine(target, draft)
    verifier, drafter = engine.kv.allocator, engine.proposer.kv.allocator
    request = dict(prompt=SYSTEM + QUESTIONS[0], max_new_tokens=8, num_draft=3)

    def run() -> tuple[list[int], tuple[int, int]]:
        before = (verifier.cached_tokens, drafter.cached_tokens)
        out = _one_by_one(engine, [request])[0]
        return out, (verifier.cached_tokens - before[0], drafter.cached_tokens - before[1])

    first, _ = run()
    again, (v, d) = run()
    assert again == first and v == 20 and d > 0
    forgotten = engine.reset_prefix_cache()
    assert engine.has_work() and not forgotten.done()
    engine.step()
    assert forgotten.result(timeout=0) >= 5 and (verifier.num_idle, drafter.num_idle) == (0, 0)
    assert run() == (first, (0, 0))
    again, (v, d) = run()
    assert again == first and v == 20 and d > 0
    assert verifier.num_used == drafter.num_used == 0
