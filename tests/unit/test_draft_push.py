"""Drafts pushed ahead: between rounds the drafter drafts the next ones as if each round
before is accepted whole (the target's next token guessed), and pushes them; the verifier
takes a push without a round trip only where its committed tokens are exactly the ones the
push assumed."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import replace

import grpc
import pytest

from drafter_service.combined import CombinedProposer
from drafter_service.draft_model import DraftModelProposer
from drafter_service.server import AHEAD_ROUNDS, DrafterServicer
from drafter_service.suffix import SuffixProposer
from protos.specd.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc
from specd.config import EngineConfig
from specd.lookup import NgramProposer, ngram_propose
from specd.model_thread import model_thread
from specd.models.loader import load_model
from specd.params import SamplingParams
from specd.proposal import DraftState, Proposal
from specd.serving import start_server
from specd.telemetry import DRAFTER_PUSHED, setup
from tests.conftest import TEST_DEVICE, make_tiny_pair, run_engine
from verifier_service.drafter_client import RemoteProposer
from verifier_service.engine import Engine
from verifier_service.request import Request

CYCLE = [11, 12, 13, 14, 15]  # a text that repeats: a lookup continues it


def state(tokens: list[int], k: int, seq_id=1) -> DraftState:
    return DraftState(seq_id, list(tokens), SamplingParams(), k)


def test_a_lookup_drafts_the_rounds_after_as_if_each_is_accepted():
    proposer = NgramProposer()
    tokens = CYCLE + CYCLE[:3]
    [p] = proposer.propose([state(tokens, 2)])
    assert p.tokens == [14, 15]
    [(first, ahead)] = proposer.draft_ahead()
    # the drafts accepted, then the lookup's own next token as the target's
    assert first.tokens == tokens + [14, 15, 11] and ahead.tokens == [12, 13]
    [(second, further)] = proposer.draft_ahead()  # the round after that one
    assert second.tokens == first.tokens + [12, 13, 14] and further.tokens == [15, 11]
    assert further.tokens == ngram_propose(second.tokens, 2)


class _ModelAhead:
    """A draft model's part of a combined drafter: no drafts, one round made ahead."""

    available = True

    def propose(self, states):
        return [Proposal() for _ in states]

    def draft_ahead(self, stop=lambda: False):
        return [(state([1, 2, 3], 2, seq_id=9), Proposal([4, 5]))]

    def close(self, seq_id):
        pass


def test_a_combined_drafter_drafts_its_lookups_ahead_beside_the_models():
    proposer = CombinedProposer(_ModelAhead())
    tokens = CYCLE * 2 + CYCLE[:3]
    [p] = proposer.propose([state(tokens, 2)])
    assert p.tokens == [14, 15] and p.ngram
    model, (looked, ahead) = proposer.draft_ahead()
    assert model[0].seq_id == 9
    assert looked.tokens == tokens + [14, 15, 11] and ahead.tokens == [12, 13] and ahead.ngram
    [_, (further, _)] = proposer.draft_ahead()
    assert further.tokens == looked.tokens + [12, 13, 14]


def test_a_suffix_drafter_drafts_ahead_from_its_routes_memory():
    proposer = SuffixProposer(None, min_match=4)
    earlier = list(range(100, 140))
    first = replace(state([1, 2, 3] + earlier, 2), route="r", prompt_length=3)
    proposer.propose([first])
    proposer.close(1)  # its response joins the route's memory
    tokens = [7, 8, 9] + earlier[:6]  # a new request repeating it
    s = replace(state(tokens, 3, seq_id=2), route="r", prompt_length=3)
    [p] = proposer.propose([s])
    assert p.tokens == earlier[6:9] and proposer.shared_rounds == 1
    [(assumed, ahead)] = proposer.draft_ahead()
    assert assumed.tokens == tokens + earlier[6:10] and ahead.tokens == earlier[10:13]
    assert assumed.route == "r" and proposer.shared_rounds == 1  # made ahead: not counted


def test_only_a_round_drafted_whole_and_free_is_continued():
    proposer = NgramProposer()
    proposer.propose([state([1, 2, 3], 2)])  # nothing repeats: no drafts
    assert proposer.draft_ahead() == []
    # sampled, seeded or not (a seeded request's tokens are its seed's drafted or not)
    for seed in (5, None):
        sampled = SamplingParams(temperature=1, seed=seed)
        proposer.propose([replace(state(CYCLE + CYCLE[:3], 2), params=sampled)])
        assert len(proposer.draft_ahead()) == 1
    proposer.propose([state(CYCLE + CYCLE[:3], 2)])
    proposer.close(1)  # ended: nothing to draft ahead for
    assert proposer.draft_ahead() == []


def serve(servicer):
    """Serve `servicer` on an event loop of its own thread: yields its address, then
    stops it."""
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    def add(server):
        drafter_pb2_grpc.add_DrafterServicer_to_server(servicer, server)

    names = [drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name]
    server, port, _ = asyncio.run_coroutine_threadsafe(
        start_server("127.0.0.1", 0, add, names), loop
    ).result(10)
    yield f"127.0.0.1:{port}"
    asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)


@pytest.fixture
def drafter():
    """A lookup drafter, served -> its address and servicer."""
    servicer = DrafterServicer(NgramProposer(), vocab_size=100)
    served = serve(servicer)
    yield next(served), servicer
    next(served, None)


def connected(address: str, telemetry=None) -> RemoteProposer:
    remote = RemoteProposer(address, telemetry=telemetry)
    deadline = time.monotonic() + 10
    while not remote.available:
        assert time.monotonic() < deadline, "no handshake"
        time.sleep(0.01)
    return remote


def pushed(remote: RemoteProposer, seq_id: int, rounds: int) -> None:
    """Wait until `rounds` pushes for the sequence have arrived."""
    deadline = time.monotonic() + 10
    while len(remote._ahead.get(seq_id, {})) < rounds:
        assert time.monotonic() < deadline, "no push arrived"
        time.sleep(0.01)


def test_the_verifier_takes_pushed_drafts_without_asking(drafter):
    address, servicer = drafter
    telemetry = setup("verifier", metrics=True)
    remote = connected(address, telemetry)
    asked = []
    ask = remote._ask
    remote._ask = lambda states: asked.append(len(states)) or ask(states)
    try:
        tokens = CYCLE + CYCLE[:3]
        [p] = remote.propose([state(tokens, 2)])
        assert p.tokens == [14, 15] and asked == [1]
        pushed(remote, 1, AHEAD_ROUNDS)
        for accepted in ([14, 15, 11], [12, 13, 14], [15, 11, 12]):
            tokens = tokens + accepted  # every draft accepted, the guess right
            [p] = remote.propose([state(tokens, 2)])
            assert p.tokens == ngram_propose(tokens, 2) and p.ngram
        assert asked == [1, 0, 0, 0] and remote.ahead_taken == 3  # no request sent
        assert telemetry.registry.get_sample_value(f"{DRAFTER_PUSHED}_total") == 3
        assert servicer.num_sessions == 1
    finally:
        remote.shutdown()


@pytest.mark.parametrize("commit", [[14, 15, 99], [14, 99], [14, 15, 11, 12]])
def test_pushed_drafts_for_other_tokens_are_not_taken(drafter, commit):
    """A draft rejected, the target's next token not the one guessed, or one token more
    than assumed: the verifier asks, and the drafter drafts from its real tokens."""
    address, _ = drafter
    remote = connected(address)
    try:
        tokens = CYCLE + CYCLE[:3]
        remote.propose([state(tokens, 2)])
        pushed(remote, 1, 1)
        tokens = tokens + commit
        [p] = remote.propose([state(tokens, 2)])
        assert remote.ahead_taken == 0
        assert p.tokens == ngram_propose(tokens, 2)
    finally:
        remote.shutdown()


def test_pushes_end_with_their_sequence(drafter):
    address, _ = drafter
    remote = connected(address)
    try:
        remote.propose([state(CYCLE + CYCLE[:3], 2)])
        pushed(remote, 1, 1)
        remote.close(1)
        assert 1 not in remote._ahead
    finally:
        remote.shutdown()


def test_pushed_drafts_keep_the_targets_greedy_output(tmp_path_factory):
    """The draft model a copy of the target: every round is accepted whole and every guess
    right, so each step after the first can draft from a push (the test waits for it);
    the output is plain decoding's, token for token, and no KV block is left."""
    folder, _ = make_tiny_pair(tmp_path_factory, "push")
    target, twin = (load_model(folder, dtype="fp32", device=TEST_DEVICE) for _ in range(2))
    proposer = DraftModelProposer(twin, num_blocks=256, block_size=4)
    served = serve(DrafterServicer(proposer, twin.args.vocab_size, draft_ahead=True))
    address = next(served)
    remote = connected(address)
    config = EngineConfig(num_blocks=256, block_size=4)
    try:
        requests = [dict(prompt=p, max_new_tokens=20) for p in ([5, 6, 7], list(range(30, 50)))]
        plain = run_engine(Engine(target, config, None, eos_ids=set()), requests)
        engine = Engine(target, config, remote, eos_ids=set())
        ids = [engine.add_request(Request(**r, num_draft=3)) for r in requests]
        out = {i: [] for i in ids}
        while engine.has_work():
            for o in engine.step():
                out[o.seq_id].extend(o.tokens)
            for i in ids:  # the drafter's push for the tokens now committed
                seq = engine.sequence(i)
                if seq is not None and seq.stats.rounds:
                    deadline = time.monotonic() + 10
                    while len(seq.tokens) not in remote._ahead.get(i, {}):
                        assert time.monotonic() < deadline, "no push for the committed tokens"
                        time.sleep(0.005)
        assert list(out.values()) == list(plain.values())
        assert remote.ahead_taken >= engine.totals.rounds // 2 > 0
        assert engine.kv.allocator.num_used == 0
    finally:
        remote.shutdown()
        next(served, None)


def _round(seq_id: int, tokens: list[int], k: int, constraint=None) -> drafter_pb2.DraftRequest:
    """A first round: open the sequence at `tokens` and draft k."""
    request = drafter_pb2.DraftRequest(round=0)
    cmd = request.commands.add(seq_id=seq_id)
    cmd.open.token_ids.extend(tokens)
    if constraint is not None:
        cmd.open.constraint.CopyFrom(constraint)
    request.commands.add(seq_id=seq_id).step.k = k
    return request


@pytest.fixture
def busy_model_thread():
    """The drafter's model thread held by other work until the test lets it go."""
    release = threading.Event()
    held = model_thread("drafter").submit(release.wait, 30)
    yield release
    release.set()
    held.result(10)


def test_a_lookups_round_is_answered_while_the_model_thread_is_busy(drafter, busy_model_thread):
    """A lookup runs no model: its round is answered on the event loop, without the hop to
    the model thread and back."""
    address, _ = drafter
    with grpc.insecure_channel(address) as channel:
        replies = drafter_pb2_grpc.DrafterStub(channel).Draft(
            iter([_round(1, CYCLE + CYCLE[:3], 2)]), timeout=10
        )
        first = next(replies)  # DEADLINE_EXCEEDED if it waited for the thread
        assert list(first.proposals[0].tokens) == [14, 15] and first.lookup_only


def test_a_round_that_compiles_a_constraint_waits_for_the_model_thread(drafter, busy_model_thread):
    """Compiling a grammar may take long: that round runs on the model thread, not on the
    event loop that answers health checks."""
    address, _ = drafter
    with grpc.insecure_channel(address) as channel:
        request = _round(1, CYCLE + CYCLE[:3], 2, common_pb2.Constraint(json_object=True))
        replies = drafter_pb2_grpc.DrafterStub(channel).Draft(iter([request]), timeout=10)
        answered = threading.Event()
        reader = threading.Thread(target=lambda: next(replies) and answered.set(), daemon=True)
        reader.start()
        assert not answered.wait(0.5)
        busy_model_thread.set()
        assert answered.wait(10)
