"""The controller deciding from whole measured steps, and its bounded exploring."""

import collections
import random

import pytest

from specd.speculation_config import SpeculationConfig
from verifier_service.speculation.acceptance import expected_tokens
from verifier_service.speculation.controller import Controller
from verifier_service.speculation.costs import StepCostModel
from verifier_service.speculation.step_shape import Candidate

# whole decode steps of the int4 1.5B target with the 0.5B drafter on the 2-core CPU, the
# mean seconds by (sequences, k) on held-out code prompts (docs/benchmarks-log.md section 19)
CODE_STEP_S = {
    (1, 0): 0.059, (1, 2): 0.136, (1, 4): 0.198, (1, 6): 0.253,
    (4, 0): 0.086, (4, 2): 0.232, (4, 4): 0.342, (4, 6): 0.472,
}  # fmt: skip
CODE_ACCEPT = [0.9, 0.86, 0.8, 0.75, 0.7, 0.65]  # a_i by position on those prompts
# whole decode steps of one sequence by k on the AVX2 CPU (docs/benchmarks-log.md section 40)
AVX2_STEP_S = {0: 0.0348, 1: 0.0586, 2: 0.0789, 3: 0.0987, 4: 0.1276, 5: 0.153, 6: 0.1614}


def test_exploring_skips_a_k_that_the_measured_line_prices_far_behind():
    """Batch 4 on the CPU: plain and k = 1, 2 measured, k = 3-6 sit on their line far
    behind plain and are never explored (the composed guess had priced k = 5 at a third of
    what it took); with only k = 1 measured, k = 2 is unpriced and explored first."""
    accept = [0.8, 0.7, 0.6, 0.5, 0.4, 0.3]

    def true_s(k):
        return 0.09 if k == 0 else 0.15 + 0.09 * k

    def explored(ks_measured) -> set[int]:
        c = Controller(SpeculationConfig(explore_every=4, explore_steps=1, explore_cap_s=100))
        c.costs.record_forward(4, 0.09)  # the composed guess: drafting looks cheap
        c.costs.record_draft(4, 1, 0.01)
        for k in (0, *ks_measured):
            for _ in range(3):
                c.costs.record_step([k] * 4, true_s(k))
        ks = set()
        for _ in range(64):
            ks.add(c.plan([Candidate(6, accept)] * 4).ks[0])
        return ks

    assert explored((1, 2)) <= {0, 1, 2}
    assert 2 in explored((1,))


def test_sequences_near_their_end_are_not_explored():
    """Batch 6 at the end of a mixed c = 8 cell: drafting is unpriced there, so it is due
    an episode, but with a few tokens left the sequences have no steps to use it."""

    def explored(remaining: int) -> set[int]:
        c = Controller(SpeculationConfig(explore_every=4, explore_steps=1, explore_cap_s=100))
        for _ in range(3):
            c.costs.record_step([0] * 6, 0.065)
        ks = set()
        for _ in range(16):
            plan = c.plan([Candidate(6, [0.6], remaining=remaining)] * 6)
            ks.add(plan.ks[0])
        return ks

    assert explored(9) == {0}
    assert explored(9) != explored(64)


def test_a_k_whose_episode_measured_nothing_is_not_explored_again_for_it():
    """Steps whose drafts were all lookups price no whole step (a lookup's round is no draft
    model's): an episode there leaves its k unmeasured. Such a k is tried once at a batch
    size, and after that explored only where it is predicted near the best."""
    c = Controller(SpeculationConfig(explore_every=4, explore_steps=1, explore_cap_s=100))
    c.costs.record_forward(1, 0.003)  # the forward flat in rows, as on a GPU
    c.costs.record_forward(5, 0.003)
    ks = collections.Counter(c.plan([Candidate(4, [0.8])]).ks[0] for _ in range(400))
    assert ks[4] >= 390
    assert ks[1] == 1 and ks[2] <= 1 and ks[3] <= 1


def measured(step_s: dict) -> Controller:
    c = Controller(SpeculationConfig(explore_every=0))
    for (sequences, k), seconds in step_s.items():
        c.costs.record_step([k] * sequences, seconds)
    return c


def test_measured_steps_decide_one_sequence_drafts_and_four_go_near_plain():
    c = measured(CODE_STEP_S)
    alone = c.plan([Candidate(6, CODE_ACCEPT)])
    assert alone.reasons == ["on"] and alone.ks[0] >= 2 and alone.gain > 1.15
    # four sequences: k = 2 within 1% of plain, the deeper k 5% and more below it: the
    # plan is one of the two, every sequence alike
    rate = {k: 4 * expected_tokens(CODE_ACCEPT, k) / CODE_STEP_S[(4, k)] for k in (0, 2, 4, 6)}
    assert abs(rate[2] / rate[0] - 1) < 0.01 and max(rate[4], rate[6]) < 0.95 * rate[0]
    four = c.plan([Candidate(6, CODE_ACCEPT) for _ in range(4)])
    assert four.ks in ([0] * 4, [2] * 4) and four.gain < 1.01


def test_a_drafting_step_before_any_drafter_round_is_priced_at_its_forward():
    """No round measured yet: the forward by rows alone (the first round measures the
    rest), and once a round is measured, the forward plus that round."""
    costs = StepCostModel()
    assert costs.composed(4, 1, 3) is None  # nothing measured
    costs.record_forward(4, 0.06)
    assert costs.composed(4, 1, 3) == pytest.approx(0.06)
    costs.record_draft(1, 3, 0.03)
    assert costs.composed(4, 1, 3) == pytest.approx(0.09)
    assert costs.composed(4, 0, 0) == pytest.approx(0.06)  # plain: the forward


def test_measured_steps_overrule_the_composed_estimate():
    # composed: rows cost nothing and a draft step is cheap, so k = 6 looks best...
    c = Controller(SpeculationConfig(explore_every=0))
    for rows in (1, 7, 28):
        c.costs.record_forward(rows, 0.06)
    c.costs.record_draft(1, 6, 0.03)
    assert c.plan([Candidate(6, CODE_ACCEPT)]).ks == [6]
    # ...but whole steps measured k = 6 slow (tree leaves, catch-up, round trips)
    c.costs.record_step([6], 0.5)
    c.costs.record_step([2], 0.12)
    assert c.plan([Candidate(6, CODE_ACCEPT)]).ks == [2]
    # k = 1, below the k measured, is priced at its parts until such a step runs
    assert c.costs(1, 1, 2, 1) == pytest.approx(c.costs.composed(2, 1, 1))


def simulate(c: Controller, true_s, accept, cap: int, steps: int) -> list[int]:
    """Plan `steps` decode steps of one sequence; each is recorded at its true cost."""
    ks = []
    for _ in range(steps):
        k = c.plan([Candidate(cap, accept)]).ks[0]
        c.costs.record_step([k], true_s(k))
        ks.append(k)
    return ks


def best_k(true_s, accept, cap: int) -> int:
    return max(range(cap + 1), key=lambda k: expected_tokens(accept, k) / true_s(k))


@pytest.mark.parametrize(
    "name,true_s",
    [
        # a fresh verifier guesses every step costs the same, so it drafts its cap; the
        # truth: drafting a step costs 90% of a forward, and nothing pays (plain wins)
        ("plain pays", lambda k: 0.06 * (1 + 0.9 * k)),
        # a fixed part per round and a cost per draft: a middle k wins
        ("a middle k", lambda k: 0.06 + (0.04 + 0.02 * k if k else 0.0)),
    ],
)
def test_exploring_finds_the_best_k_and_costs_a_bounded_share(name, true_s):
    accept, cap = [0.8], 6
    c = Controller()  # nothing measured: every guess is the same
    ks = simulate(c, true_s, accept, cap, 40 * c.config.explore_every)
    best = best_k(true_s, accept, cap)
    late = ks[len(ks) // 2 :]
    assert collections.Counter(late).most_common(1)[0][0] == best, name
    # exploring: at most one episode of explore_steps in explore_every steps
    share = sum(k != best for k in late) / len(late)
    assert share <= c.config.explore_steps / c.config.explore_every + 0.01, name


def test_without_exploring_a_pessimistic_guess_stays_wrong():
    """Why the episodes exist: with only the composed guess, plain (never measured while
    drafting) keeps the cost of the measured drafting forwards and is never tried."""
    c = Controller(SpeculationConfig(explore_every=0))
    c.costs.record_forward(7, 0.2)  # only drafting forwards measured: plain looks as dear

    def true_s(k):
        return 0.06 * (1 + 0.9 * k)

    ks = simulate(c, true_s, [0.8], 6, 200)
    assert best_k(true_s, [0.8], 6) == 0 and 0 not in ks


def test_a_switch_costs_what_its_step_took_over_the_steady_one():
    c = Controller(SpeculationConfig(explore_every=0))
    c.costs.record_step([2, 2], 0.5, catch_up=200)  # no steady (2, 2) step yet: unknown
    assert c.costs.switch_s(200, 0) == 0.0 and c.costs.steps(2, 2) is None
    c.costs.record_step([2, 2], 0.2)
    c.costs.record_step([0, 0], 0.07)
    c.costs.record_step([2, 2], 0.5, catch_up=200)  # a new prompt: +0.3 s
    c.costs.record_step([2, 0], 0.25, catch_up=3)  # 2 plain steps to catch up: +0.05 s
    c.costs.record_step([0, 0], 0.09, stopping=2)  # both stop drafting: +0.02 s
    assert c.costs.switch_s(200, 0) == pytest.approx(0.3)
    assert c.costs.switch_s(4, 0) == pytest.approx(0.05)  # 3 tokens kept at 4
    assert c.costs.switch_s(0, 2) == pytest.approx(0.02)
    assert c.costs.switch_s(3, 2) == pytest.approx(0.07)
    assert c.costs.steps(2, 2) == 0.2 and c.costs.steps(2, 0) == 0.07  # steady untouched


def test_a_switch_pays_for_itself_before_the_batch_flips():
    # four sequences gain 20% a step by drafting 2, once the drafter has caught up; a new
    # prompt costs the drafter 0.1 s each
    accept, plain_s = [0.9, 0.86], 0.086
    drafting_s = 4 * expected_tokens(accept, 2) / (1.2 * 4 / plain_s)
    c = measured({(4, 0): plain_s, (4, 2): drafting_s})
    c.costs.record_step([2] * 4, drafting_s + 0.4, catch_up=4 * 200)

    def batch(behind: int, remaining: int):
        return c.plan([Candidate(2, accept, behind=behind, remaining=remaining)] * 4)

    assert batch(200, 64).ks == [2] * 4  # 24 steps to spread 0.4 s over: +10%
    assert batch(200, 8).ks == [0] * 4  # 3 steps: the catch-up costs more than they gain
    assert batch(0, 8).ks == [2] * 4  # caught up already: nothing to pay
    # a drafting batch 1.6% slower than plain per step stays where stopping costs more
    # than that (the drafter's work ahead, spread over the steps left), and only there
    for stop_s, stays in ((0.02, False), (0.2, True)):
        tie = measured({(4, 0): plain_s, (4, 2): drafting_s * 1.22})
        assert tie.plan([Candidate(2, accept, remaining=64)] * 4).ks == [0] * 4
        tie.costs.record_step([0] * 4, plain_s + stop_s, stopping=4)
        assert tie.plan([Candidate(2, accept, remaining=64)] * 4).ks == [2 * stays] * 4


def test_in_a_dip_no_sequence_starts_catching_the_drafter_up():
    # alone, a code sequence gains by drafting even with its prompt's catch-up priced
    # whole; but a moment ago the batch was larger (and ran plain), and it comes back
    # within a step or two: the catch-up would buy a round or two and delay its prefill
    c = measured(CODE_STEP_S)
    c.costs.record_step([2], CODE_STEP_S[(1, 2)] + 0.01, catch_up=60)
    fresh = Candidate(6, CODE_ACCEPT, behind=60, remaining=64)
    assert c.plan([fresh]).ks[0] > 0
    c.config.horizon = 1  # the catch-up priced whole: still worth it alone
    assert c.plan([fresh]).ks[0] > 0
    dip = c.plan([fresh], dip=True)
    assert dip.ks == [0] and dip.reasons == ["off:cost"]
    caught_up = Candidate(6, CODE_ACCEPT, remaining=64)  # it drafted last step: no switch
    assert c.plan([caught_up], dip=True).ks == c.plan([caught_up]).ks != [0]
    # one that ran plain for its batch's last step or two is a few tokens behind: no more
    # than its round drafts ride in its first round, so it is not kept plain in the dip
    lately = Candidate(6, CODE_ACCEPT, behind=2, remaining=64)
    assert c.plan([lately], dip=True).ks == c.plan([lately]).ks != [0]
    for behind, drafts in ((2, True), (3, False)):
        short = Candidate(2, CODE_ACCEPT, behind=behind, remaining=64)
        assert c.plan([short]).ks != [0]
        assert (c.plan([short], dip=True).ks != [0]) == drafts
    assert c.plan([lately, fresh], dip=True).ks == [0, 0]
    # beside one that would have to catch up, those that drafted go plain too: the
    # batch that comes back decides from plain
    both = c.plan([caught_up, fresh], dip=True)
    assert both.ks == [0, 0] and both.reasons == ["off:cost"] * 2
    # a probe would catch up too: one under its route's floor waits for a step not a dip
    due = Candidate(6, [0.3], probe=True, floor=0.5, behind=60, remaining=64)
    assert c.plan([due], dip=True).ks == [0]
    assert c.plan([due]).reasons == ["probe"]


def test_nothing_explores_in_a_dip():
    c = measured(CODE_STEP_S)
    c.config.explore_every = 1  # an episode due at every step, and the budget to pay it
    c.config.explore_cap_s = c.budget_s = 100.0
    caught_up = [Candidate(6, CODE_ACCEPT, remaining=64)] * 2
    arm = c.plan(caught_up, dip=True).ks
    assert all(c.plan(caught_up, dip=True).ks == arm for _ in range(8))
    assert any(c.plan(caught_up).ks != arm for _ in range(8))


def run_batch(c: Controller, accept, true_s, switch_s, steps: int, probe_every: int = 0):
    """`steps` decode steps of a batch of 8 that never changes; each is recorded at its
    true cost plus what its switches cost. -> seconds spent beyond plain decoding."""
    behind, lost = [100] * 8, 0.0
    for step in range(steps):
        due = bool(probe_every) and step % probe_every == probe_every - 1
        plan = c.plan([Candidate(3, accept, due, 0.5, b, 64) for b in behind])
        catch_up = sum(b for b, k in zip(behind, plan.ks, strict=True) if k)
        stopping = sum(1 for b, k in zip(behind, plan.ks, strict=True) if not k and not b)
        seconds = true_s(max(plan.ks)) + (switch_s if catch_up else 0.0)
        c.costs.record_step(plan.ks, seconds, catch_up, stopping)
        tokens = sum(expected_tokens(accept, k) for k in plan.ks)
        lost += seconds - tokens * true_s(0) / 8  # over plain, for the same tokens
        behind = [0 if k else b + 1 for b, k in zip(behind, plan.ks, strict=True)]
    return lost


def big_batch_exploring(slower: float, share: float, steps: int = 2000) -> float:
    """Seconds lost to exploring by eight sequences on the CPU where a drafting step makes
    `slower` x plain's tokens/s, and the drafter's catch-up for all eight costs 0.4 s, ~3.5
    plain steps (section 20)."""
    accept = [0.8, 0.7, 0.6]

    def true_s(k):
        return 0.116 if not k else 0.116 * expected_tokens(accept, k) / slower

    c = Controller(SpeculationConfig(explore_share=share))
    c.costs.record_step([0] * 8, true_s(0))
    return run_batch(c, accept, true_s, 0.4, steps)


def test_exploring_a_big_batch_near_a_tie_costs_its_share_of_time_not_of_steps():
    # drafting 1% slower than plain: close enough to be worth a look now and then, all
    # run long. One episode in 32 steps would have lost ~0.45 s each: ~12% of the time.
    # The budget's share bounds it, beside the cap it starts with
    steps, cap = 2000, SpeculationConfig().explore_cap_s
    for share in (SpeculationConfig().explore_share, 0.03, 0.1):
        seconds = big_batch_exploring(0.99, share, steps)
        assert 0.1 < seconds <= 1.25 * share * steps * 0.116 + cap  # it still explored


def test_the_exploring_window_narrows_by_episodes_at_one_batch_size():
    c = Controller()
    window = c.config.explore_window
    assert c._explore_floor(2, 3) == pytest.approx(1 - window)
    c._episodes[(2, 3)] = 3
    assert c._explore_floor(2, 3) == pytest.approx(1 - window / 2)  # 1 / sqrt(1 + 3)
    assert c._explore_floor(2, 4) == c._explore_floor(4, 3) == pytest.approx(1 - window)


def test_exploring_a_k_measured_behind_plain_slows_down_whatever_the_budget():
    # drafting 8% slower: each episode narrows the window for k at this batch size, so
    # it is explored more seldom than any budget allows
    spent = {share: big_batch_exploring(0.92, share) for share in (0.015, 0.03, 0.1)}
    assert len(set(spent.values())) == 1
    allowed = 1.25 * 0.015 * 2000 * 0.116 + SpeculationConfig().explore_cap_s
    assert 0.1 < spent[0.1] < 0.6 * allowed


def test_probes_behind_a_big_batch_are_paid_from_the_same_budget():
    def true_s(k):
        return 0.116 if not k else 0.25

    c = Controller()
    c.costs.record_step([0] * 8, true_s(0))
    steps = 2000
    # below the route's floor: only probes draft, and all eight are due every 16 steps
    lost = run_batch(c, [0.3], true_s, 0.4, steps, probe_every=16)
    assert lost <= 1.2 * c.config.explore_share * steps * true_s(0) + c.config.explore_cap_s
    assert lost > 0  # some probes still ran: a route off for acceptance still recovers


def test_the_budget_holds_a_seconds_worth_or_its_steps_worth_whichever_is_less():
    # on a device whose steps take 3 ms a second is ~330 steps, all of them spent in
    # probes and episodes at every start; on the CPU's 0.116 s steps the second binds
    def budget(step_s: float, batch: int) -> float:
        c = Controller()
        c.costs.record_step([0] * batch, step_s)
        c.costs.record_forward(batch, step_s)
        for _ in range(4):  # under the route's floor: the plain arm is planned
            c.plan([Candidate(3, [0.3], floor=0.5)] * batch)
        return c.budget_s

    cfg = SpeculationConfig()
    assert budget(0.003, 1) == pytest.approx(cfg.explore_cap_steps * 0.003)
    assert budget(0.116, 8) == pytest.approx(cfg.explore_cap_s)


def test_a_fresh_route_under_break_even_at_the_prior_still_measures_itself():
    """A route that has never drafted starts from the prior (0.7). On a device where a
    drafting round has a dear fixed part, every k at 0.7 is predicted more than
    `explore_window` behind plain, so no episode explores it. The route's sequences are
    then kept plain by their (prior) acceptance, not by the device: at 0.95, k = 6 makes
    ~1.5x plain here. So they probe, measure, and draft; they must not stay plain for good
    (issue 15's latch, for a route that never drafted)."""

    def true_s(k):
        return 0.035 if k == 0 else 0.09 + 0.008 * k

    accept = 0.95
    c = measured({(1, k): true_s(k) for k in range(7)})
    c.config.explore_every = 32  # exploring on, as by default
    c.routes.clock = lambda: 0.0
    prior = [c.config.prior_acceptance]
    floor = (1 - c.config.explore_window) * (1 / true_s(0))
    assert all(expected_tokens(prior, k) / true_s(k) < floor for k in range(1, 7))
    assert best_k(true_s, [accept], 6) == 6
    rnd, off, drafted = random.Random(0), 0, []
    for _ in range(200):
        accept_rates = c.route_rates("edit")
        due = off + 1 >= c.config.probe_every
        k = c.plan([Candidate(6, accept_rates, due, 0.5)]).ks[0]
        took = 0
        while took < k and rnd.random() < accept:
            took += 1
        c.costs.record_step([k], true_s(k))
        c.record("edit", k, took)
        off = 0 if k else off + 1
        drafted.append(k)
    first = next((i for i, k in enumerate(drafted) if k), None)
    assert first is not None and first <= 2 * c.config.probe_every
    assert sum(k >= 4 for k in drafted[100:]) >= 90  # and once measured, it drafts long


def test_a_batch_that_would_not_draft_even_at_good_acceptance_does_not_probe():
    """Code at c = 4 on the AVX2 CPU (section 40): a fresh route's sequences sit near the
    prior. Each alone would draft at 0.9, but four of them would not draft at 0.9 either
    (plain 74 ms a step for 4 tokens, k = 2 ~245 ms for ~11): `off:cost`, and no probe
    (one catches the drafter up on a whole prompt beside the batch: `auto` ran at 0.90 of
    plain at c = 4 when such sequences probed). Alone, the same sequence probes."""
    steps = {(1, k): s for k, s in AVX2_STEP_S.items()}
    steps.update({(4, k): 0.074 if k == 0 else 0.154 + 0.045 * k for k in range(7)})
    c = measured(steps)
    low = Candidate(6, [0.65], probe=True, floor=0.5)
    four = c.plan([low] * 4)
    assert four.ks == [0] * 4 and set(four.reasons) == {"off:cost"}
    one = c.plan([low])
    assert one.ks == [1] and one.reasons == ["probe"]
