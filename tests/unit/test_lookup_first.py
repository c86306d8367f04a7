"""A `combined` drafter's lookup made by the verifier (RemoteProposer._look_first): where the
drafter's handshake says it looks a sequence's own text up first, the verifier looks it up
itself and drafts from it with no round trip; it asks the drafter only where the lookup
finds nothing, and the drafter's model then drafts from every token committed since."""

from __future__ import annotations

import pytest

from drafter_service.combined import CombinedProposer
from drafter_service.draft_model import DraftModelProposer
from drafter_service.server import DrafterServicer
from protos.specd.v1 import drafter_pb2
from specd.config import EngineConfig
from specd.models.loader import load_model
from specd.proposal import Proposal
from specd.telemetry import DRAFTER_LOOKED_UP, setup
from tests.conftest import TEST_DEVICE, make_tiny_pair, run_engine
from tests.unit.test_draft_push import CYCLE, connected, serve, state
from verifier_service.engine import Engine

MODEL_DRAFTS = [90, 91]


class _Model:
    """A draft model's part of a combined drafter: drafts MODEL_DRAFTS, keeps what it saw."""

    available = True

    def __init__(self):
        self.seen: list[list[int]] = []

    def propose(self, states):
        self.seen += [list(s.tokens) for s in states]
        return [Proposal(MODEL_DRAFTS[: s.k]) for s in states]

    def draft_ahead(self, stop=lambda: False):
        return []

    def close(self, seq_id) -> None:
        pass


def _remote(proposer):
    """A RemoteProposer connected to `proposer` served as a drafter that never pushes, with
    metrics; its asks counted in `asked`."""
    servicer = DrafterServicer(proposer, vocab_size=100)
    servicer.draft_ahead = False
    served = serve(servicer)
    telemetry = setup("verifier", metrics=True)
    remote = connected(next(served), telemetry)
    remote.telemetry = telemetry
    remote.asked = []
    ask = remote._ask
    remote._ask = lambda states: remote.asked.append(len(states)) or ask(states)
    return remote, served


@pytest.fixture
def combined():
    model = _Model()
    remote, served = _remote(CombinedProposer(model))
    yield remote, model
    remote.shutdown()
    next(served, None)


def test_the_verifier_looks_up_what_a_combined_drafter_would_and_asks_for_the_rest(combined):
    remote, model = combined
    own = CombinedProposer(_Model())  # the drafter's own answers, in-process
    tokens = CYCLE + CYCLE[:3]  # repeats: the lookup drafts
    [p] = remote.propose([state(tokens, 2)])
    assert p.tokens == own.propose([state(tokens, 2)])[0].tokens == [14, 15] and p.ngram
    assert remote.asked == [0] and remote.looked_up == 1 and model.seen == []
    looked_up = remote.telemetry.registry.get_sample_value(f"{DRAFTER_LOOKED_UP}_total")
    assert looked_up == 1  # as the verifier's metric says it
    tokens = tokens + [14, 15, 11, 77, 78, 79]  # ends in no 3 tokens seen before
    [p] = remote.propose([state(tokens, 2)])
    assert p.tokens == own.propose([state(tokens, 2)])[0].tokens == MODEL_DRAFTS
    assert not p.ngram and remote.asked == [0, 1]
    assert model.seen == [tokens]  # every committed token, those the lookup drafted for too
    remote.close(1)
    assert len(remote.lookups) == 0


def test_a_drafter_that_does_not_look_up_is_asked_every_round():
    model = _Model()
    remote, served = _remote(model)
    try:
        tokens = CYCLE + CYCLE[:3]
        [p] = remote.propose([state(tokens, 2)])
        assert p.tokens == MODEL_DRAFTS and remote.asked == [1] and remote.looked_up == 0
    finally:
        remote.shutdown()
        next(served, None)


def test_greedy_output_is_the_targets_with_the_lookup_in_the_verifier(tmp_path_factory):
    """The tiny pair through a served combined drafter: a prompt that repeats drafts by
    the verifier's lookup, one that does not by the draft model; the output is plain
    decoding's token for token, and no KV block is left."""
    folder, draft_folder = make_tiny_pair(tmp_path_factory, "lookup-first")
    target = load_model(folder, dtype="fp32", device=TEST_DEVICE)
    draft = load_model(draft_folder, dtype="fp32", device=TEST_DEVICE)
    proposer = CombinedProposer(DraftModelProposer(draft, num_blocks=256, block_size=4))
    remote, served = _remote(proposer)
    config = EngineConfig(num_blocks=256, block_size=4)
    try:
        prompts = [[5, 6, 7, 8] * 6, list(range(30, 50))]
        requests = [dict(prompt=p, max_new_tokens=24) for p in prompts]
        plain = run_engine(Engine(target, config, None, eos_ids=set()), requests)
        engine = Engine(target, config, remote, eos_ids=set())
        drafted = run_engine(engine, [r | {"num_draft": 3} for r in requests])
        assert list(drafted.values()) == list(plain.values())
        assert remote.looked_up > 0 and sum(remote.asked) > 0
        assert engine.kv.allocator.num_used == 0 and len(remote.lookups) == 0
    finally:
        remote.shutdown()
        next(served, None)


def test_pushes_the_lookup_made_useless_are_dropped(combined):
    """Pushes for the tokens a lookup drafted from, or fewer, can never be taken: dropped,
    so a sequence that drafts by lookups holds no pile of them; one for more tokens stays."""
    remote, _ = combined
    tokens = CYCLE + CYCLE[:3]
    n = len(tokens)
    remote._ahead[1] = {f: drafter_pb2.SeqProposal(seq_id=1) for f in (n - 3, n, n + 3)}
    [p] = remote.propose([state(tokens, 2)])
    assert p.ngram and list(remote._ahead[1]) == [n + 3]
