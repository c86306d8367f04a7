"""The verifier engine fed by proposers that know the greedy answer: a branch taken every
round (tree verification keeps parity), and rounds a drafter stops short (what the
controller learns from them)."""

import pytest

from specd.config import EngineConfig
from specd.proposal import Proposal
from tests.conftest import run_engine
from tests.unit.test_engine import PROMPTS, _calls, make_engine
from verifier_service.engine import Engine
from verifier_service.request import Request
from verifier_service.speculation.acceptance import expected_tokens


def greedy_answers(tiny_pair, reqs: list[dict]) -> dict[tuple, list[int]]:
    """Each prompt's greedy output without speculation, longest prompts first (a short
    prompt ends in its first prefix: look the longest up first)."""
    off = run_engine(make_engine(tiny_pair), reqs)
    answers = {tuple(r["prompt"]): out for r, out in zip(reqs, off.values(), strict=True)}
    return dict(sorted(answers.items(), key=lambda kv: -len(kv[0])))


class OracleProposer:
    """Knows the greedy answer. With `wrong_at`, drafts it with one token wrong at that
    depth and the right token as the alternative beside it, so every round goes down a
    branch; with `most`, drafts at most that many right tokens whatever k a round asks
    for (as a drafter whose p_min stops every round there)."""

    available = True

    def __init__(self, answers, vocab: int, wrong_at: int | None = None, most: int | None = None):
        self.answers, self.vocab, self.wrong_at, self.most = answers, vocab, wrong_at, most

    def propose(self, states):
        return [self._proposal(s) for s in states]

    def _proposal(self, s) -> Proposal:
        prompt = next(p for p in self.answers if list(p) == s.tokens[: len(p)])
        done = len(s.tokens) - len(prompt)
        right = self.answers[prompt][done : done + min(s.k, self.most or s.k)]
        if self.wrong_at is None or len(right) <= self.wrong_at:
            return Proposal(tokens=right)
        chain = list(right)
        chain[self.wrong_at] = (right[self.wrong_at] + 1) % self.vocab
        return Proposal(tokens=chain, alts=[(self.wrong_at, right[self.wrong_at])])

    def close(self, seq_id):
        pass


@pytest.mark.parametrize("wrong_at", [0, 2])
def test_a_branch_taken_every_round_keeps_parity(tiny_pair, wrong_at):
    target, _ = tiny_pair
    reqs = [dict(prompt=p, max_new_tokens=24) for p in PROMPTS[:2]]
    answers = greedy_answers(tiny_pair, reqs)
    proposer = OracleProposer(answers, target.args.vocab_size, wrong_at=wrong_at)
    engine = Engine(target, EngineConfig(num_blocks=256, block_size=4), proposer, eos_ids=set())
    moved = _calls(engine.kv, "move")
    on = run_engine(engine, [dict(r, num_draft=4) for r in reqs])
    assert list(on.values()) == [answers[tuple(r["prompt"])] for r in reqs]
    assert len(moved) >= 4  # every full round moved the branch's K/V
    # each full round accepts up to the branch: wrong_at + 1 drafts
    assert engine.totals.accepted >= (wrong_at + 1) * 4
    assert engine.kv.allocator.num_used == 0


def test_a_round_stopped_short_counts_as_planned_for_the_controller(tiny_pair):
    """Rounds planned at k = 4 that come back with one (accepted) draft: the controller
    learns position 1 as missed, so its E(4) is what such rounds make (2 tokens), while
    the response and the load report count the drafts that came."""
    target, _ = tiny_pair
    reqs = [dict(prompt=p, max_new_tokens=24) for p in PROMPTS[:2]]
    proposer = OracleProposer(greedy_answers(tiny_pair, reqs), target.args.vocab_size, most=1)
    engine = Engine(target, EngineConfig(num_blocks=256, block_size=4), proposer, set())
    outputs = []
    ids = [engine.add_request(Request(**dict(r, num_draft=4))) for r in reqs]
    while engine.has_work():
        outputs += [o for o in engine.step() if o.finish_reason]
    assert {o.seq_id for o in outputs} == set(ids)
    for o in outputs:
        assert o.stats.drafted == o.stats.accepted == o.stats.rounds > 5  # one draft a round
    controller = engine.speculation.controller
    rates = controller.route_rates("default")
    assert rates[0] > 0.9 and rates[1] < 0.2  # position 1 missed, not untried
    assert controller.routes.rates()["default"] == pytest.approx(1.0)  # accepted / drafted
    assert expected_tokens(rates, 4) < 2.2
