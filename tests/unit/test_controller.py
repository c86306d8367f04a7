"""The speculation controller as a pure function of recorded costs and acceptance."""

import random

import pytest

from specd.speculation_config import SpeculationConfig
from verifier_service.request import SpeculationBounds
from verifier_service.speculation.acceptance import PositionAcceptance, expected_tokens
from verifier_service.speculation.controller import Controller
from verifier_service.speculation.costs import CostCurve
from verifier_service.speculation.route_acceptance import RouteAcceptance
from verifier_service.speculation.step_shape import Candidate

# one decode step of the 1.5B target at int4 on the 2-core CPU, by rows in the forward,
# and one draft step of the 0.5B drafter by sequences, plus a round's fixed part (catch-up,
# round trip) (docs/benchmarks-log.md section 10)
FORWARD_S = {1: 0.067, 4: 0.077, 7: 0.088, 16: 0.152, 32: 0.290, 64: 0.560, 128: 1.10}
DRAFT_STEP_S = {1: 0.022, 4: 0.030, 8: 0.045, 16: 0.080}
DRAFT_ROUND_S = 0.010


def draft_round(sequences: int, k: int) -> float:
    return DRAFT_ROUND_S + k * DRAFT_STEP_S[sequences]


def recorded() -> Controller:
    """Composed costs only (no whole step measured), no exploring episodes."""
    c = Controller(SpeculationConfig(explore_every=0))
    for rows, s in FORWARD_S.items():
        c.costs.record_forward(rows, s)
    for seqs in DRAFT_STEP_S:
        for k in (1, 2, 4, 8):
            c.costs.record_draft(seqs, k, draft_round(seqs, k))
    return c


def test_expected_tokens_by_hand():
    assert expected_tokens([0.5], 0) == 1.0
    assert expected_tokens([0.5], 2) == 1 + 0.5 + 0.25
    assert expected_tokens([1.0, 0.5, 0.0], 4) == 1 + 1 + 0.5 + 0 + 0
    assert expected_tokens([0.9, 0.5], 3) == pytest.approx(1 + 0.9 + 0.45 + 0.225)


def test_cost_curve_interpolates_and_extrapolates_along_its_span():
    curve = CostCurve()
    assert curve(4) is None
    curve.record(1, 1.0)
    assert curve(7) == 1.0  # one size: flat
    curve.record(9, 3.0)
    assert curve(5) == pytest.approx(2.0)
    assert curve(0) == 1.0  # below the smallest: flat
    # past the largest: on along the line from the smallest size (0.25 s a size here)
    assert curve(17) == pytest.approx(5.0)
    curve.record(13, 2.0)  # a noisy end: the line still runs from the smallest size
    assert curve(25) == pytest.approx(3.0)
    falling = CostCurve()
    falling.record(4, 2.0)
    falling.record(8, 1.0)
    assert falling(100) == 1.0  # never down
    rounds = CostCurve(origin=True)  # a drafter round by steps
    rounds.record(3, 0.06)
    assert rounds(6) == pytest.approx(0.12) and rounds(1) == 0.06
    curve.record(1, 2.0)  # the second event replaces the first, which may run cold
    assert curve(1) == 2.0
    curve.record(1, 1.0)  # then an EMA, not the last sample
    assert 1.0 < curve(1) < 2.0
    curve.record(3, 0.0)  # nonsense timings are ignored
    assert 3 not in curve.measured()


def test_position_acceptance_counts_reached_positions():
    acc = PositionAcceptance()
    acc.record(4, 2)  # positions 0, 1 accepted, 2 rejected, 3 never reached
    acc.record(4, 4)
    assert acc.trials == [2, 2, 2, 1] and acc.hits == [2, 2, 1, 1]
    rates = acc.rates([0.5], strength=2.0)
    assert rates[0] == pytest.approx((2 + 1) / (2 + 2))
    # past the prior's end, a position's prior is the rate of the one before it
    assert rates[1] == pytest.approx((2 + 2 * rates[0]) / (2 + 2))
    assert rates[2] == pytest.approx((1 + 2 * rates[1]) / (2 + 2))
    acc.record(1, 1)  # k = 1: position 0 alone tried, the others keep their counts
    assert acc.trials == [3, 2, 2, 1] and acc.hits == [3, 2, 1, 1]
    acc.limit(1.0)
    assert acc.trials[0] == pytest.approx(1.0) and acc.hits[0] == pytest.approx(1.0)


def test_one_sequence_on_a_cpu_drafts_as_far_as_acceptance_pays():
    c = recorded()
    great = c.plan([Candidate(8, [0.95])])
    assert great.reasons == ["on"] and 5 <= great.ks[0] <= 8 and great.gain > 1.6
    good = c.plan([Candidate(8, [0.85])])
    assert 2 <= good.ks[0] < great.ks[0] and 1.2 < good.gain < great.gain
    fair = c.plan([Candidate(8, [0.7])])
    assert 1 <= fair.ks[0] <= good.ks[0]
    poor = c.plan([Candidate(8, [0.15])])
    assert poor.ks == [0] and poor.reasons == ["off:acceptance"] and poor.gain == 1.0


def test_the_best_k_is_the_argmax_of_the_predicted_rate():
    c = recorded()
    for alpha in (0.5, 0.7, 0.9):
        plan = c.plan([Candidate(8, [alpha])])
        forward = c.costs.forward
        rates = [
            expected_tokens([alpha], k) / (forward(1 + k) + (draft_round(1, k) if k else 0.0))
            for k in range(9)
        ]
        best = max(range(9), key=lambda k: rates[k])
        assert plan.ks[0] == best
        assert plan.gain == pytest.approx(rates[best] / rates[0])
        # what it expects of the step it chose (Engine.priced holds it against the step)
        assert plan.tokens == pytest.approx(expected_tokens([alpha], best))
        assert plan.seconds == pytest.approx(
            forward(1 + best) + (draft_round(1, best) if best else 0)
        )


def test_a_loaded_batch_goes_off_for_cost_not_for_acceptance():
    # 16 sequences: 16 rows cost 2.3x one row, and each draft row costs nearly a full row
    c = recorded()
    batch = [Candidate(6, [0.7]) for _ in range(16)]
    plan = c.plan(batch)
    assert plan.ks == [0] * 16 and set(plan.reasons) == {"off:cost"}
    # the same sequences alone draft
    assert c.plan(batch[:1]).ks[0] > 0


def test_a_device_where_rows_cost_goes_off_for_cost_even_alone():
    # the AVX2 CPU (docs/benchmarks-log.md section 21): 7 rows cost 3x one and the drafter shares
    # the cores, so even one sequence at a code route's acceptance decodes faster plain.
    # Its reason is the cost, not its acceptance, and it does not probe for acceptance.
    c = Controller(SpeculationConfig(explore_every=0))
    for rows, s in {1: 0.064, 4: 0.13, 7: 0.19, 9: 0.24}.items():
        c.costs.record_forward(rows, s)
    for k in (1, 2, 4, 8):
        c.costs.record_draft(1, k, 0.01 + 0.03 * k)
    for accept in ([0.8], [0.15]):
        plan = c.plan([Candidate(6, accept, probe=True, floor=0.1)])
        assert plan.ks == [0] and plan.reasons == ["off:cost"], accept
    # where rows are cheap the same poor sequence is off for its acceptance
    assert recorded().plan([Candidate(6, [0.15], floor=0.1)]).reasons == ["off:acceptance"]


def test_a_fresh_verifier_on_this_cpu_prices_a_bigger_batch_past_what_it_measured():
    # what a verifier has seen after one sequence drafted (rows up to 7, rounds of one
    # sequence) and plain batches of up to 4 (docs/benchmarks-log.md section 28): a batch of 4
    # drafting 6 feeds 28 rows, never measured. Priced flat, as the 7-row forward, it
    # looked 2x plain and the batch drafted; along the measured line it is not
    c = Controller(SpeculationConfig(explore_every=0))
    for rows, s in {1: 0.056, 2: 0.067, 3: 0.086, 4: 0.099, 5: 0.111, 7: 0.134}.items():
        c.costs.record_forward(rows, s)
    for k in (1, 2, 4, 6):
        c.costs.record_draft(1, k, 0.04 + 0.02 * k)
    assert c.costs.forward(28) == pytest.approx(0.134 + 21 * (0.134 - 0.056) / 6)
    batch = [Candidate(6, [0.9]) for _ in range(4)]
    assert c.plan(batch).ks == [0] * 4


def test_a_sequence_below_its_routes_floor_is_left_out_of_a_good_round():
    # a device where up to 16 rows cost one (bf16 on AMX, a GPU), more cost more, and
    # drafts are cheap: the poor sequence's 6 rows would cost and bring nothing
    c = Controller(SpeculationConfig(explore_every=0))
    c.costs.record_forward(1, 0.1)
    c.costs.record_forward(16, 0.1)
    c.costs.record_forward(32, 0.2)
    for k in (1, 6):
        c.costs.record_draft(2, k, 0.005 * k)
        c.costs.record_draft(1, k, 0.004 * k)
    batch = [Candidate(6, [0.9], floor=0.5), Candidate(6, [0.02], floor=0.5)]
    plan = c.plan(batch + [Candidate(6, [0.8], floor=0.5)])
    assert plan.ks[0] > 0 and plan.ks[1] == 0 and plan.ks[2] > 0
    assert plan.reasons == ["on", "off:acceptance", "on"]


def test_a_batch_on_this_cpu_drafts_less_than_one_sequence():
    # on the int4 CPU, rows are not free: each draft row costs ~5 ms of the forward and
    # the round's drafter time stalls every sequence of the batch
    c = recorded()
    alone = c.plan([Candidate(8, [0.95])])
    four = c.plan([Candidate(8, [0.95]) for _ in range(4)])
    assert sum(four.ks) / 4 < alone.ks[0] and four.gain < alone.gain


def flat_costs(sequences: int) -> Controller:
    """A step of `sequences` costs 1 s plain and 1.5 s at k = 1, from plain decoding."""
    c = Controller(SpeculationConfig(explore_every=0))
    c.costs.record_forward(sequences, 1.0)
    c.costs.record_forward(2 * sequences, 1.0)
    c.costs.record_draft(sequences, 1, 0.5)
    return c


def test_a_step_drafts_where_it_predicts_more_tokens_a_second_and_a_tie_runs_plain():
    # E(1) = 1 + a over 1.5 s against 1 token over 1 s: drafting pays above a = 0.5
    for n in (1, 4):
        assert flat_costs(n).plan([Candidate(1, [0.55])] * n).ks == [1] * n  # 1.033x
        assert flat_costs(n).plan([Candidate(1, [0.5])] * n).ks == [0] * n
        assert flat_costs(n).plan([Candidate(1, [0.45])] * n).ks == [0] * n


def test_a_route_below_its_floor_probes_at_k1_only_when_due():
    c = recorded()
    low = [0.3]
    assert c.plan([Candidate(6, low, probe=False, floor=0.5)]).reasons == ["off:acceptance"]
    plan = c.plan([Candidate(6, low, probe=True, floor=0.5)])
    assert plan.ks == [1] and plan.reasons == ["probe"]
    assert plan.seconds == 0.0  # a probe is not the step the plan priced
    # a good route above its floor never "probes": it drafts
    assert c.plan([Candidate(6, [0.9], probe=True, floor=0.5)]).reasons == ["on"]
    # a loaded batch (off for cost) does not probe either, above its floor or without one
    for floor in (0.0, 0.5):
        busy = [Candidate(6, [0.78], probe=True, floor=floor) for _ in range(16)]
        plan = c.plan(busy)
        assert plan.ks == [0] * 16 and set(plan.reasons) == {"off:cost"}


def test_route_acceptance_decays_back_to_the_prior_with_time():
    now = [0.0]
    routes = RouteAcceptance(
        SpeculationConfig(route_half_life_s=10.0, route_short_rounds=64), lambda: now[0]
    )
    for _ in range(500):  # a burst of rejected rounds
        routes.record("chat", 4, 0)
    acc = routes.positions("chat")
    assert acc.trials[0] == pytest.approx(64)  # never worth more than 64 rounds
    assert acc.rates([0.7], 2.0)[0] < 0.05
    assert routes.rates()["chat"] == 0.0
    now[0] = 60.0  # six half-lives later the burst weighs 1 round
    assert routes.positions("chat").rates([0.7], 2.0)[0] > 0.45
    assert routes.estimate("chat", [0.7], 2.0)[0] > 0.45  # in the long memory too


def test_a_bad_streak_at_the_end_leaves_the_route_near_its_level():
    """Drafting stops on a bad streak, so the last rounds a route saw before its sequences
    went plain are its worst: they must not set the estimate its next requests start
    from (a short memory alone puts it at 0.50, under the 0.7 prior): the long memory
    holds the route's level."""
    routes = RouteAcceptance(clock=lambda: 0.0)
    for i in range(200):  # position 0 accepted 4 times in 5
        routes.record("chat", 1, int(i % 5 != 0))
    for _ in range(4):
        routes.record("chat", 1, 0)
    assert routes.positions("chat").rates([0.7], 2.0)[0] < 0.55  # the short memory
    assert routes.estimate("chat", [0.7], 2.0)[0] > 0.72


def test_a_lucky_streak_does_not_lift_a_route_over_its_level():
    """The short memory replaces the long one only where it is higher by more than its
    noise: six accepted rounds in a row happen at 0.8 (one time in four), and taking the
    higher of the two memories made k flip on them."""
    routes = RouteAcceptance(clock=lambda: 0.0)
    for i in range(200):
        routes.record("chat", 1, int(i % 5 != 0))
    for _ in range(6):
        routes.record("chat", 1, 1)
    assert routes.positions("chat").rates([0.7], 2.0)[0] > 0.86  # the short memory
    assert routes.estimate("chat", [0.7], 2.0)[0] < 0.84


def test_a_position_no_longer_drafted_returns_toward_the_one_before():
    """k drops when a deep position looks bad, and then nothing measures it: it fades
    toward the position before it, which every round measures."""
    routes = RouteAcceptance(clock=lambda: 0.0)
    for _ in range(8):
        routes.record("chat", 2, 1)  # position 1 rejected every time
    assert routes.positions("chat").rates([0.7], 2.0)[1] < 0.3
    for _ in range(30):
        routes.record("chat", 1, 1)  # k = 1, all accepted: position 1 never reached
    assert routes.estimate("chat", [0.7], 2.0)[1] > 0.8


def test_a_position_measured_low_is_not_held_there_once_no_round_reaches_it():
    """The long memory full of rounds where position 1 was accepted half the time, then only
    k = 1 rounds: nothing measures position 1, and the short memory alone is not far enough
    above the long one to be taken. As the long memory turns over (each round past its
    bound scales every position down) position 1 drifts back toward position 0's rate, its
    prior, even where no time passes: else k would stay one short for good."""
    routes = RouteAcceptance(clock=lambda: 0.0)
    rnd = random.Random(0)
    for _ in range(64):  # k = 2: position 0 accepted at 0.9, position 1 at 0.5
        routes.record("code", 2, 1 + (rnd.random() < 0.5) if rnd.random() < 0.9 else 0)
    before = routes.estimate("code", [0.7], 2.0)
    assert before[1] < 0.45
    for _ in range(5 * 64):  # five long memories' worth
        routes.record("code", 1, int(rnd.random() < 0.9))
    after = routes.estimate("code", [0.7], 2.0)
    assert after[1] > 0.7 and after[0] - after[1] < 0.15


def test_one_rejected_round_does_not_stop_a_good_route():
    """A round's outcome does not predict the next one's: the route's long memory holds
    its level, and the short one replaces it only where it is higher."""
    c = recorded()
    c.routes.clock = lambda: 0.0
    for i in range(64):
        c.routes.record("chat", 1, int(i % 5 != 0))  # a route that accepts 0.8
    for _ in range(3):
        c.record("chat", 1, 0)
    assert c.route_rates("chat")[0] > 0.75
    assert c.plan([Candidate(1, c.route_rates("chat"))]).ks == [1]


def test_recovery_after_a_bad_burst_within_a_few_probes():
    """The latch of issue 15: a burst of 0% rounds on a route, then normal traffic.
    Probing at k = 1 every 16 steps must bring the route back to drafting, with no time
    passing at all (the time decay is the second, independent way back)."""
    c = recorded()
    c.routes.clock = lambda: 0.0
    for _ in range(300):
        c.routes.record("chat", 3, 0)
    steps_off, on_at = 0, None
    for step in range(400):
        accept = c.route_rates("chat")
        cand = Candidate(3, accept, probe=steps_off + 1 >= c.config.probe_every, floor=0.5)
        k, reason = (lambda p: (p.ks[0], p.reasons[0]))(c.plan([cand]))
        if reason == "on":
            on_at = step
            break
        steps_off = 0 if k else steps_off + 1
        c.record("chat", k, k)  # the new traffic accepts what it drafts
    assert on_at is not None and on_at <= 10 * c.config.probe_every
    probes = on_at // c.config.probe_every
    assert probes <= 10  # the probing cost: at most one k = 1 round in 16 steps, bounded


@pytest.mark.parametrize(
    "decisions,rounds,reason",
    [
        ({"on": 5, "off:batch": 9}, 5, "on"),
        ({"off:acceptance": 30, "probe": 2}, 2, "probe"),
        ({"off:batch": 3, "off:kv": 5}, 0, "off:kv"),
        ({"on": 4}, 0, "off:drafter-unavailable"),
        ({"off:request": 4}, 0, "off:request"),
        ({}, 0, "off:request"),
    ],
)
def test_a_request_reason_agrees_with_its_counts(decisions, rounds, reason):
    from collections import Counter

    assert SpeculationBounds.reason(Counter(decisions), rounds) == reason


def test_bounds_refuse_nan_and_out_of_range():
    for bad in (float("nan"), -0.1, 1.5, float("inf")):
        with pytest.raises(ValueError, match="max_kv_utilization"):
            SpeculationBounds(max_kv_utilization=bad).validate()
        with pytest.raises(ValueError, match="min_acceptance"):
            SpeculationBounds(min_acceptance=bad).validate()
    with pytest.raises(ValueError, match="draft_below_batch"):
        SpeculationBounds(draft_below_batch=-1).validate()


def test_a_batch_drafts_where_it_predicts_a_gain_whether_it_drafted_or_not():
    """No band between starting and staying: what makes a drafting batch stay is what
    stopping costs, priced (test_controller_steps: a switch pays for itself)."""
    c = flat_costs(4)

    def plan(accept: float) -> list[int]:
        return c.plan([Candidate(1, [accept])] * 4).ks

    assert plan(0.45) == [0] * 4  # 0.97x
    assert plan(0.55) == [1] * 4  # 1.033x
    assert plan(0.45) == [0] * 4  # drafting last step: plain as well


def test_without_the_cost_model_auto_drafts_its_cap_but_still_probes():
    c = Controller(SpeculationConfig(), cost_model=False)
    plan = c.plan([Candidate(6, [0.6]), Candidate(3, [0.2], floor=0.5)])
    assert plan.ks == [6, 0] and plan.reasons == ["on", "off:acceptance"]
    plan = c.plan([Candidate(3, [0.2], probe=True, floor=0.5)])
    assert plan.ks == [1] and plan.reasons == ["probe"]


def test_a_sequence_kept_plain_under_its_floor_keeps_its_place_in_the_step():
    """`_capped` leaves a candidate under its floor plain and nothing else changed: one
    that already ran plain (the drafter behind it) is not stopping, and one that drafted
    last step is."""
    from verifier_service.speculation.controller import _capped, _switching

    plain = Candidate(4, [0.2], floor=0.5, behind=12, remaining=30, goes_on=[0.5])
    capped = _capped(plain)
    assert (capped.cap, capped.behind, capped.remaining, capped.goes_on) == (0, 12, 30, [0.5])
    assert _switching([capped], [0]) == (0, 0)
    drafting = Candidate(4, [0.2], floor=0.5, behind=0)
    assert _switching([_capped(drafting)], [0]) == (0, 1)


def test_a_deep_position_measured_high_is_kept_while_shallower_rounds_run():
    """Code accepts deeper drafts more often than the third (a copied stretch, once
    entered, goes on): positions 3-5 measured at 0.95 under a position 2 of 0.75. Rounds
    of k = 3 cannot reach them; pulled down to position 2 they would make k = 3 look best
    and keep it so, as nothing deeper would run to measure them again (log section 70)."""
    routes = RouteAcceptance(clock=lambda: 0.0)
    rnd = random.Random(1)

    def run(k: int, accept: list[float]) -> int:
        n = 0
        while n < k and rnd.random() < accept[n]:
            n += 1
        return n

    deep = [0.9, 0.9, 0.75, 0.95, 0.95, 0.95]
    for _ in range(64):
        routes.record("code", 6, run(6, deep))
    before = routes.estimate("code", [0.7], 2.0)
    assert min(before[3:]) > 0.88 and before[2] < 0.82
    for _ in range(40):
        routes.record("code", 3, run(3, deep))
    after = routes.estimate("code", [0.7], 2.0)
    assert min(after[3:]) > 0.88
    assert expected_tokens(after, 6) > expected_tokens(before, 6) - 0.1


def cheap_rows() -> Controller:
    """A batch of 4 whose forward costs 3 ms a row past 4, and a drafter round 15 ms a
    draft: deep rounds pay for a route accepting 95%, not for one accepting 50%."""
    c = Controller(SpeculationConfig(explore_every=0))
    c.costs.record_forward(4, 0.1)
    c.costs.record_forward(28, 0.1 + 24 * 0.003)
    for k in (1, 6):
        c.costs.record_draft(4, k, 0.015 * k)
    return c


def step_s(c: Controller, k: int) -> float:
    return c.costs.forward(4 * (1 + k)) + (0.015 * k if k else 0.0)


def test_a_step_of_two_routes_slows_neither_below_plain():
    code, chat = [Candidate(6, [0.95])] * 2, [Candidate(6, [0.5])] * 2
    c = cheap_rows()

    def rate(accept: float, k: int) -> float:  # one sequence's predicted tokens/s
        return expected_tokens([accept], k) / step_s(c, k)

    def total(k: int) -> float:
        return 2 * rate(0.95, k) + 2 * rate(0.5, k)

    best_total = max(range(7), key=total)
    assert best_total == 4 and rate(0.5, 4) < rate(0.5, 0)  # chat would pay for code's k
    fair = [k for k in range(1, 7) if rate(0.5, k) >= rate(0.5, 0)]
    plan = c.plan(code + chat)
    assert plan.ks == [max(fair, key=total)] * 4 == [3] * 4
    assert c.plan(code * 2).ks[0] >= best_total  # code alone: as deep as the best total
    # chat's last tokens, which end in this round (its cap is what is left), hold nothing
    ending = c.plan(code + [Candidate(4, [0.5], remaining=5)] * 2).ks
    assert ending[0] > 3 and ending[2:] == [4, 4] and rate(0.5, ending[0]) < rate(0.5, 0)
