"""The drafter's context window (`--context-window`, specd.proposal.view_start): a long
prompt is drafted as if its last tokens were the whole prompt, computing only those; a
prompt short enough, or one the prefix cache holds all but the window of, from its first
token; a conversation's next turn in the same band finds the turn before's blocks; the
engine's greedy output is the target's either way; and the verifier prices a new
sequence's catch-up at what the drafter's window computes, told in the handshake."""

import pytest
import torch

from drafter_service.combined import CombinedProposer
from drafter_service.draft_model import DraftModelProposer
from drafter_service.server import DrafterServicer
from drafter_service.suffix import SuffixProposer
from specd.config import EngineConfig, context_window
from specd.models.loader import load_model
from specd.params import SamplingParams
from specd.proposal import DraftState
from tests.conftest import make_tiny_pair, run_engine
from tests.unit.test_draft_push import connected, serve
from verifier_service.engine import Engine
from verifier_service.records import SeqView
from verifier_service.request import Request

pytestmark = pytest.mark.usefixtures("cpu_kernels")  # fails, not skips, in CI

W, BLOCK = 16, 4
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    """A tiny draft at int4: chunk-invariant, so K/V from the cache are the ones computing
    them gives (the proposals below are compared bit for bit)."""
    _, folder = make_tiny_pair(tmp_path_factory, prefix="dw")
    return load_model(folder, dtype="bf16", device="cpu", weights="int4")


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def drafts(proposer: DraftModelProposer, tokens: list[int], seq_id=1, k=4) -> list[int]:
    return proposer.propose([DraftState(seq_id, tokens, GREEDY, k)])[0].tokens


def computed(proposer: DraftModelProposer, seq_id=1) -> int:
    """Tokens whose K/V the drafter holds for the sequence."""
    return proposer.kv.allocator.length(seq_id)


class Counted:
    """A model whose forwards count the tokens they are fed."""

    def __init__(self, model):
        self.model, self.fed = model, 0

    def forward(self, kv, seqs):
        self.fed += sum(len(s.tokens) for s in seqs)
        return self.model.forward(kv, seqs)

    def __getattr__(self, name):
        return getattr(self.model, name)


def test_a_long_prompt_is_drafted_from_its_last_tokens_only(draft):
    prompt = ids(45, seed=1)  # the view starts at (45 - 16) // 16 * 16 = 16: 29 tokens
    windowed = DraftModelProposer(Counted(draft), 64, BLOCK, context_window=W)
    alone = DraftModelProposer(draft, 64, BLOCK)  # given the view as its whole prompt
    whole = DraftModelProposer(draft, 64, BLOCK)
    got = drafts(windowed, prompt)
    assert got == drafts(alone, prompt[16:])
    assert computed(windowed) == computed(alone) == 29 + 3  # the view, 3 drafts fed
    drafts(whole, prompt)
    assert computed(whole) == 45 + 3
    # the next round: two drafts accepted and a token of the target's, as from the view
    went_on = prompt + got[:2] + [7]
    before = windowed.model.fed
    assert drafts(windowed, went_on) == drafts(alone, went_on[16:])
    assert computed(windowed) == computed(alone)
    assert windowed.model.fed - before == 1 + 3  # the new token, then the drafts: no view again


def test_a_prompt_under_twice_the_window_is_drafted_whole(draft):
    prompt = ids(2 * W, seed=2)  # (32 - 16) // 16 * 16 = 16 > 0: windowed ...
    short = prompt[:-1]  # ... and 31 tokens: (31 - 16) // 16 = 0, the first token
    windowed = DraftModelProposer(draft, 64, BLOCK, context_window=W)
    whole = DraftModelProposer(draft, 64, BLOCK)
    assert drafts(windowed, short) == drafts(whole, short)
    assert computed(windowed) == computed(whole) == 31 + 3
    drafts(windowed, prompt, seq_id=2)
    assert computed(windowed, 2) == 16 + 3


def test_a_cached_prefix_keeps_the_first_token_in_view(draft):
    first = ids(30, seed=3)
    proposer = DraftModelProposer(draft, 128, BLOCK, prefix_cache=True, context_window=W)
    drafts(proposer, first)
    proposer.close(1)  # publishes the 30 tokens' 7 full blocks (28 tokens)
    longer = first + ids(10, seed=4)  # 40: 12 not cached, within the window
    fresh = DraftModelProposer(draft, 128, BLOCK)
    assert drafts(proposer, longer, seq_id=2) == drafts(fresh, longer)
    alloc = proposer.kv.allocator
    assert alloc.cached_tokens == 28 and computed(proposer, 2) == 40 + 3
    # without the cache the same 40 tokens would start at 16
    cold = DraftModelProposer(draft, 128, BLOCK, context_window=W)
    drafts(cold, longer)
    assert computed(cold) == 24 + 3


def test_the_next_turn_in_the_same_band_finds_the_windows_blocks(draft):
    turn = ids(36, seed=5)  # starts at 16: a 20-token view
    proposer = DraftModelProposer(draft, 128, BLOCK, prefix_cache=True, context_window=W)
    drafts(proposer, turn)
    proposer.close(1)  # publishes the view's blocks, keyed from its start
    nxt = turn + ids(10, seed=6)  # 46 tokens: still (46 - 16) // 16 * 16 = 16
    fresh = DraftModelProposer(draft, 128, BLOCK)
    assert drafts(proposer, nxt, seq_id=2) == drafts(fresh, nxt[16:])
    assert proposer.kv.allocator.cached_tokens == 20  # the view's 5 full blocks


def test_greedy_output_is_the_targets_with_a_windowed_drafter(tiny_pair):
    target, draft = tiny_pair
    # 9 tokens, and two past twice the window (the tiny pair agrees on such runs)
    prompts = [list(range(40, 49)), list(range(40, 90)), [20, 31, 42, 53, 64, 75, 86] * 10]
    cfg = EngineConfig(num_blocks=512, block_size=BLOCK, cost_model=False)

    def run(proposer):
        engine = Engine(target, cfg, proposer, eos_ids=set())
        requests = [dict(prompt=p, max_new_tokens=24, num_draft=4) for p in prompts]
        return list(run_engine(engine, requests).values()), engine

    plain, _ = run(None)
    windowed, engine = run(DraftModelProposer(draft, 256, BLOCK, context_window=W))
    assert windowed == plain
    assert engine.totals.accepted > 0


def test_auto_is_a_window_on_a_cpu_only():
    assert context_window("auto", "cpu") > 0
    assert context_window("auto", "cuda") == 0
    assert context_window("64", "cuda") == 64
    assert context_window("0", "cpu") == 0


def test_a_new_sequence_is_behind_by_what_the_window_computes(draft):
    """The engine prices a first round's catch-up (SeqView.behind) at the tokens the
    drafter computes: 70 - view_start(70, 16) = 70 - 48; the whole prompt without one."""
    cfg = EngineConfig(num_blocks=256, block_size=BLOCK)
    prompt = ids(70, seed=7)
    for window, behind in ((W, 22), (0, 70)):
        proposer = CombinedProposer(DraftModelProposer(draft, 64, BLOCK, context_window=window))
        engine = Engine(draft, cfg, proposer, eos_ids=set())
        seq_id = engine.add_request(Request(prompt, GREEDY, max_new_tokens=8, num_draft=4))
        assert SeqView.of(engine._seqs[seq_id]).behind == behind


@pytest.mark.parametrize("wrapper", [CombinedProposer, SuffixProposer, lambda model: model])
def test_the_handshake_tells_the_drafters_window(draft, wrapper):
    proposer = wrapper(DraftModelProposer(draft, 64, BLOCK, context_window=W))
    served = serve(DrafterServicer(proposer, vocab_size=96))
    remote = connected(next(served))
    try:
        assert remote.context_window == W
    finally:
        remote.shutdown()
        next(served, None)
    assert remote.context_window == 0  # none connected
