"""A lookup's next round asked for as its step's tokens are committed
(RemoteProposer.prefetch): the next step takes the answer without a round trip where it
asks no more drafts of the same tokens, and asks anew otherwise."""

from __future__ import annotations

import pytest

from drafter_service.server import DrafterServicer
from specd.config import EngineConfig
from specd.lookup import NgramProposer, ngram_propose
from specd.models.loader import load_model
from specd.proposal import Proposal
from specd.telemetry import DRAFTER_PREFETCHED, setup
from tests.conftest import TEST_DEVICE, make_tiny_pair, run_engine
from tests.unit.test_draft_push import CYCLE, connected, serve, state
from verifier_service.engine import Engine


@pytest.fixture
def remote():
    """A RemoteProposer connected to a served lookup drafter that never pushes (so every
    round after the first is asked, or prefetched); its asks counted in `asked`, its
    metrics in `telemetry`."""
    servicer = DrafterServicer(NgramProposer(), vocab_size=100)
    servicer.draft_ahead = False
    served = serve(servicer)
    telemetry = setup("verifier", metrics=True)
    proposer = connected(next(served), telemetry)
    proposer.telemetry, proposer.asked = telemetry, []
    ask = proposer._ask
    proposer._ask = lambda states: proposer.asked.append(len(states)) or ask(states)
    yield proposer
    proposer.shutdown()
    next(served, None)


def test_a_prefetched_round_is_taken_without_asking(remote):
    tokens = CYCLE + CYCLE[:3]
    remote.propose([state(tokens, 2)])
    tokens = tokens + [14, 99]  # a draft rejected: the committed tokens the step left
    remote.prefetch([state(tokens, 2)])
    [p] = remote.propose([state(tokens, 2)])
    assert p.tokens == ngram_propose(tokens, 2)
    assert remote.asked == [1, 0] and remote.prefetched == 1
    # fewer drafts than prefetched: the first of them
    tokens = tokens + [11, 12]
    remote.prefetch([state(tokens, 3)])
    [p] = remote.propose([state(tokens, 1)])
    assert p.tokens == ngram_propose(tokens, 1) and remote.asked == [1, 0, 0]
    metrics = remote.telemetry.registry
    assert metrics.get_sample_value(f"{DRAFTER_PREFETCHED}_total") == 2


@pytest.mark.parametrize("later", ["more tokens", "more drafts"])
def test_a_prefetch_that_does_not_fit_the_step_is_asked_anew(remote, later):
    tokens = CYCLE + CYCLE[:3]
    remote.prefetch([state(tokens, 2)])
    k = 2
    if later == "more tokens":
        tokens = tokens + [14]
    else:
        k = 3
    [p] = remote.propose([state(tokens, k)])
    assert p.tokens == ngram_propose(tokens, k)
    assert remote.asked == [1] and remote.prefetched == 0
    assert remote._fetching == {}  # spent, not kept for a later step


def test_a_closed_sequence_leaves_no_prefetch(remote):
    remote.prefetch([state(CYCLE + CYCLE[:3], 2)])
    remote.close(1)
    assert remote._fetching == {}


def test_prefetching_keeps_the_targets_greedy_output(tmp_path_factory, remote):
    """Through the engine, a prompt that repeats (lookups draft, the random target mostly
    rejects them): the output is plain decoding's, token for token, rounds are
    prefetched, and neither a prefetch nor a KV block is left."""
    folder, _ = make_tiny_pair(tmp_path_factory, "prefetch")
    target = load_model(folder, dtype="fp32", device=TEST_DEVICE)
    config = EngineConfig(num_blocks=256, block_size=4)
    requests = [
        dict(prompt=CYCLE * 4, max_new_tokens=24),
        dict(prompt=CYCLE * 3, max_new_tokens=16),
    ]
    plain = run_engine(Engine(target, config, None, eos_ids=set()), requests)
    engine = Engine(target, config, remote, eos_ids=set())
    drafted = run_engine(engine, [dict(r, num_draft=3) for r in requests])
    assert list(drafted.values()) == list(plain.values())
    assert remote.prefetched > 0
    assert remote._fetching == {} and engine.kv.allocator.num_used == 0


class _ModelDrafter:
    """A drafter whose rounds run a model (no `lookup_only`)."""

    available = True

    def propose(self, states):
        return [Proposal([1] * s.k) for s in states]

    def close(self, seq_id):
        pass


def test_a_drafter_that_runs_a_model_is_never_prefetched():
    """Its answer to a round the plan does not take would hold the next round up."""
    served = serve(DrafterServicer(_ModelDrafter(), vocab_size=100))
    proposer = connected(next(served))
    try:
        assert not proposer._stream.lookup_only
        proposer.prefetch([state(CYCLE, 2)])
        assert proposer._fetching == {}
        [p] = proposer.propose([state(CYCLE, 2)])
        assert p.tokens == [1, 1] and proposer.prefetched == 0
    finally:
        proposer.shutdown()
        next(served, None)
