"""Suffix drafting (drafter_service/suffix.py): drafts from the request's own text and from
earlier responses of its route, as long as the match and its agreement allow, in bounded
memory, never across routes; and greedy output unchanged by it."""

from __future__ import annotations

from drafter_service.draft_model import DraftModelProposer
from drafter_service.suffix import KEY, ResponseIndex, SuffixProposer
from specd.config import EngineConfig
from specd.params import SamplingParams
from specd.proposal import DraftState
from tests.conftest import run_engine
from verifier_service.engine import Engine
from verifier_service.request import Request, SpeculationBounds


def test_a_stored_response_continues_a_context_that_ends_like_it():
    index = ResponseIndex(max_tokens=1000)
    index.add([50, 51, 52, 53, 54, 55, 56, 57, 58])
    match = index.continuation([9, 9, 52, 53, 54], k=8)
    assert match.tokens == [55, 56, 57] and match.length == 3  # no longer than the match
    match = index.continuation([50, 51, 52, 53, 54], k=8)
    assert match.tokens == [55, 56, 57, 58] and match.length == 5  # to the response's end
    assert index.continuation([50, 51, 52, 53, 54], k=2).tokens == [55, 56]
    assert index.continuation([1, 2, 3], k=4).tokens == []


def test_the_longest_match_and_then_the_majority_decide():
    index = ResponseIndex(max_tokens=1000)
    index.add([1, 2, 3, 10, 11, 12, 70, 71, 72])  # matches the context 6 back
    index.add([5, 5, 5, 10, 11, 12, 80, 81, 82])  # only 3 back
    assert index.continuation([1, 2, 3, 10, 11, 12], k=3).tokens == [70, 71, 72]
    split = ResponseIndex(max_tokens=1000)
    split.add([20, 21, 22, 30, 31])
    split.add([20, 21, 22, 40, 41])
    assert split.continuation([20, 21, 22], k=3).tokens == []  # one each: no majority
    split.add([20, 21, 22, 30, 31])
    assert split.continuation([20, 21, 22], k=3).tokens == [30, 31]  # two of three


def test_where_the_responses_split_the_draft_goes_wide():
    index = ResponseIndex(max_tokens=1000)
    index.add([20, 21, 22, 30, 31, 32])
    index.add([20, 21, 22, 30, 31, 32])
    index.add([20, 21, 22, 30, 35, 36])
    # 30 agreed by all; 31 by two of three (35 its sibling); past it one voter is left
    assert index.continuation([20, 21, 22], k=3).alts == []  # none asked for
    match = index.continuation([20, 21, 22], k=3, alternatives=4)
    assert match.tokens == [30, 31, 32] and match.alts == [(1, 35)]
    even = ResponseIndex(max_tokens=1000)
    even.add([20, 21, 22, 30, 31])
    even.add([20, 21, 22, 40, 41])
    # one each: without alternatives no draft; with one, both (on a tie the response
    # stored first leads) and nothing past the split
    assert even.continuation([20, 21, 22], k=3).tokens == []
    split = even.continuation([20, 21, 22], k=3, alternatives=1)
    assert split.tokens == [30] and split.alts == [(0, 40)]
    assert index.continuation([20, 21, 22], k=3, alternatives=0).tokens == [30, 31, 32]


def test_a_shared_match_proposes_its_alternatives_and_the_verifier_takes_them(tiny_pair):
    """Earlier responses that split put the runner-up beside the chain; where the chain
    is wrong the verifier takes the leaf, and greedy output stays the target's."""
    proposer = SuffixProposer(min_match=3, alternatives=2)
    for i, tail in enumerate(([64, 65, 66], [64, 65, 66], [64, 75, 76])):
        proposer.propose([state(i, [1, 2, 3, 60, 61, 62, 63] + tail, prompt_length=3)])
        proposer.close(i)
    (p,) = proposer.propose([state("b", [9, 8, 7, 61, 62, 63], k=4)])
    assert p.tokens == [64, 65, 66] and p.alts == [(1, 75)] and p.ngram
    (short,) = proposer.propose([state("c", [9, 8, 7, 61, 62, 63], k=1)])
    assert short.tokens == [64] and short.alts == []  # no leaf beside a draft not sent

    target, _ = tiny_pair
    prompt = [5, 6, 7, 8, 9, 10, 11]
    cfg = EngineConfig(num_blocks=256, block_size=4, cost_model=False)  # leaves at any price
    request = Request(prompt, max_new_tokens=24, speculation=SpeculationBounds(route="code"))

    def run(proposer):
        engine = Engine(target, cfg, proposer, eos_ids=set())
        (out,) = run_engine(engine, [vars(request) | {"num_draft": 4}]).values()
        return out, engine

    plain, _ = run(None)
    wrong = list(plain)
    wrong[12] = (plain[12] + 1) % 64  # a response that went another way at one token
    proposer = SuffixProposer(min_match=3, alternatives=2)
    index = proposer.routes["code"] = ResponseIndex(1000)
    index.add(wrong)  # stored first: it leads the tie, the right token is the leaf
    index.add(plain)
    out, engine = run(proposer)
    assert out == plain
    assert engine.tree_rounds > 0 and engine.branches_taken > 0


def test_memory_stays_bounded_and_the_oldest_responses_go_first():
    index = ResponseIndex(max_tokens=100)
    responses = [[i] * 3 + list(range(1000 + 10 * i, 1010 + 10 * i)) for i in range(30)]
    for r in responses:
        index.add(r)
        assert index.tokens <= 100
    assert list(index.docs) == list(range(30 - len(index.docs), 30))  # the newest kept
    kept = {d for entries in index.index.values() for d, _ in entries}
    assert kept == set(index.docs)  # nothing indexes an evicted response
    oldest, newest = responses[0], responses[-1]
    assert index.continuation(oldest[: KEY + 1], k=3).tokens == []
    assert index.continuation(newest[: KEY + 1], k=3).tokens == newest[KEY + 1 : KEY + 4]


def state(seq_id, tokens, route="code", prompt_length=None, k=4) -> DraftState:
    state = DraftState(seq_id, list(tokens), SamplingParams(), k)
    state.route = route
    state.prompt_length = len(tokens) if prompt_length is None else prompt_length
    return state


def test_a_response_drafts_only_for_its_own_route_and_only_when_shared():
    response = [60, 61, 62, 63, 64, 65, 66, 67]
    for shared, route, want in [
        (True, "code", [64, 65, 66]),  # as long as the match (61 62 63)
        (True, "chat", []),
        (False, "code", []),
    ]:
        proposer = SuffixProposer(min_match=3, shared=shared)
        first = state("a", [1, 2, 3] + response, route="code", prompt_length=3)
        proposer.propose([first])
        proposer.close("a")
        (p,) = proposer.propose([state("b", [9, 8, 7, 61, 62, 63], route=route)])
        assert p.tokens == want, (shared, route)
        if want:  # deterministic: one-hot q at the verifier, priced as a free round
            assert p.ngram and p.q_ids is None


def test_greedy_output_is_unchanged_and_later_requests_draft_from_earlier_ones(tiny_pair):
    target, draft = tiny_pair
    prompts = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42, 43], [70, 3, 9, 27, 12]]
    bounds = SpeculationBounds(route="code")
    reqs = [Request(p, max_new_tokens=32, num_draft=4, speculation=bounds) for p in prompts]
    cfg = EngineConfig(num_blocks=256, block_size=4)

    def run(proposer):
        engine = Engine(target, cfg, proposer, eos_ids=set())
        out = run_engine(engine, [vars(r) | {"num_draft": 4} for r in reqs])
        return list(out.values()), engine

    plain, _ = run(None)
    model_only, engine = run(DraftModelProposer(draft, num_blocks=128, block_size=4))
    assert engine.totals.rounds > 0 and engine.totals.lookup_rounds == 0
    proposer = SuffixProposer(DraftModelProposer(draft, num_blocks=128, block_size=4))
    first, _ = run(proposer)
    assert proposer.shared_rounds == 0  # nothing said yet on this route
    again, engine = run(proposer)  # the same requests: their answers are in memory now
    assert first == again == model_only == plain
    assert proposer.shared_rounds > 0 and engine.totals.accepted > 0
    # the account says which rounds were lookups (every shared one is)
    assert proposer.shared_rounds <= engine.totals.lookup_rounds < engine.totals.rounds


def test_the_route_and_the_prompt_length_cross_the_wire_to_a_drafters_session():
    from drafter_service.sessions import Sessions
    from protos.specd.v1 import drafter_pb2

    sessions = Sessions(vocab_size=96, max_draft_tokens=8)
    request = drafter_pb2.DraftRequest(round=1)
    cmd = request.commands.add(seq_id=7)
    cmd.open.token_ids.extend([5, 6, 7])
    cmd.open.prompt_length, cmd.open.route, cmd.open.suffix_private = 2, "code", True
    request.commands.add(seq_id=7).step.k = 2
    (step,) = sessions.round(0, request.commands)
    assert (step.state.route, step.state.prompt_length) == ("code", 2)
    assert step.state.suffix_private
    unnamed = drafter_pb2.DraftRequest(round=2)
    unnamed.commands.add(seq_id=8).open.token_ids.extend([5])
    unnamed.commands.add(seq_id=8).step.k = 1
    (step,) = sessions.round(0, unnamed.commands)
    assert step.state.route == "default" and not step.state.suffix_private
    bad = drafter_pb2.DraftRequest(round=3)
    cmd = bad.commands.add(seq_id=9)
    cmd.open.token_ids.extend([5])
    cmd.open.proposer = "eagle"
    bad.commands.add(seq_id=9).step.k = 1
    (step,) = sessions.round(0, bad.commands)
    assert step.state is None and "proposer must be one of" in step.problem


def test_the_verifier_sends_the_route_and_the_prompt_length():
    from protos.specd.v1 import drafter_pb2
    from verifier_service.drafter_client import RemoteProposer

    remote = RemoteProposer.__new__(RemoteProposer)  # its command building only
    remote._sent, remote._asked = {}, {}
    request = drafter_pb2.DraftRequest(round=1)
    remote._add_commands(request, state(3, [5, 6, 7, 8], route="code", prompt_length=3))
    assert (request.commands[0].open.route, request.commands[0].open.prompt_length) == ("code", 3)


class Recording:
    """A draft model stand-in: proposes [1] for every state and records whom it saw."""

    available = True

    def __init__(self):
        self.seen, self.closed = [], []

    def propose(self, states):
        from specd.proposal import Proposal

        self.seen += [s.seq_id for s in states]
        return [Proposal(tokens=[1]) for _ in states]

    def close(self, seq_id):
        self.closed.append(seq_id)


def test_each_route_drafts_the_way_its_policy_names():
    import pytest

    from router.policy import Policy
    from verifier_service.request import SpeculationBounds

    repeats = [7, 8, 9, 10, 11, 7, 8, 9, 10]  # its own text repeats: a lookup finds 11, 7...
    model = Recording()
    proposer = SuffixProposer(model)
    states = [state(m, repeats) for m in ("draft", "ngram", "combined", "suffix", "")]
    for s in states:
        s.proposer = s.seq_id
    got = {s.seq_id: p.tokens for s, p in zip(states, proposer.propose(states), strict=True)}
    assert got["draft"] == [1] and model.seen == ["draft"]  # the model, though text repeats
    assert got["ngram"] == got["combined"] == [11, 7, 8, 9]  # the lookup, no model
    assert got["suffix"] == got[""] == [11, 7, 8, 9]  # "": the drafter's own way (suffix)
    proposer.close("draft")
    assert proposer.routes == {} and model.closed == ["draft"]  # only suffix routes share
    policy = Policy.from_dict({"routes": {"agent": {"proposer": "suffix"}}})
    assert policy.for_route("agent")[1].proposer == "suffix"
    assert policy.for_route("default")[1].proposer == ""
    with pytest.raises(ValueError, match="proposer must be one of"):
        SpeculationBounds(proposer="eagle").validate()


def test_a_route_that_shares_nothing_keeps_its_responses_to_itself():
    """`suffix_shared: false` in a route's policy crosses router -> verifier -> drafter,
    and there its requests neither add to nor draft from the route's memory."""
    from protos.specd.v1 import drafter_pb2, router_pb2
    from router.decide import Decision
    from router.policy import Policy
    from router.prepare import Prepared
    from router.relay import verifier_request
    from verifier_service import server
    from verifier_service.drafter_client import RemoteProposer

    policy = Policy.from_dict({"routes": {"agent": {"suffix_shared": False}}})
    wire = {}
    for route in ("agent", "code"):
        prep = Prepared(
            router_pb2.GenerateRequest(), None, [5, 6, 7], route, [], policy.for_route(route)[1],
            8, {}, None,
        )  # fmt: skip
        request = server._request(verifier_request(prep, Decision(4, True, "auto")), route, 4,
                                  8, None, None)  # fmt: skip
        assert request.speculation.suffix_private == (route == "agent")
        remote = RemoteProposer.__new__(RemoteProposer)  # its command building only
        remote._sent, remote._asked, drafted = {}, {}, drafter_pb2.DraftRequest(round=1)
        s = state(1, [5, 6, 7], route=route)
        s.suffix_private = request.speculation.suffix_private
        remote._add_commands(drafted, s)
        wire[route] = drafted.commands[0].open.suffix_private
    assert wire == {"agent": True, "code": False}

    response = [60, 61, 62, 63, 64, 65, 66, 67]
    proposer = SuffixProposer(min_match=3)
    private = state("a", [1, 2, 3] + response, route="code", prompt_length=3)
    private.suffix_private = True
    proposer.propose([private])
    proposer.close("a")
    assert "code" not in proposer.routes  # its response was not kept
    shared = state("b", [1, 2, 3] + response, route="code", prompt_length=3)
    proposer.propose([shared])
    proposer.close("b")
    reader = state("c", [9, 8, 7, 61, 62, 63], route="code")
    assert proposer.propose([reader])[0].tokens == [64, 65, 66]
    reader.seq_id, reader.suffix_private = "d", True
    assert proposer.propose([reader])[0].tokens == []  # nor does it read the route's
