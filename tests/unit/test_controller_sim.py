"""The speculation controller on simulated code traffic at c = 1 (bench/controller_sim.py):
`auto` against the fixed k of the same trial, on texts and step costs like section 40's."""

import statistics

from bench.controller_sim import match_runs, trial


def test_the_simulated_text_accepts_like_code_does():
    """Position 0 ~0.87 and k = 3 ~2.29 drafts a round, as code at c = 1 measured."""
    import random

    runs = [r for seed in range(200) for r in match_runs(random.Random(seed), 64)]
    assert 0.85 < statistics.mean(min(r, 1) for r in runs) < 0.89
    assert 2.15 < statistics.mean(min(r, 3) for r in runs) < 2.4


def test_auto_keeps_up_with_the_best_fixed_k():
    """Twelve sweeps of k = 2, k = 3 and `auto`. Before round 32, one of these (seed 10)
    never drafted: the route started at the prior (0.7), under break-even there, was
    `off:cost` and so never probed (0.87 of k = 2), and the line through the measured k
    mispriced the rest (mean 0.973)."""
    ratios = []
    for seed in range(12):
        r = trial(seed)
        ratios.append(r["auto"] / max(r[2], r[3]))
    assert min(ratios) > 0.95, ratios
    assert statistics.mean(ratios) > 0.975, ratios


def test_a_recorded_text_accepts_the_run_of_matches_from_each_decode_step():
    """Output token 0 is the prefill's; the step at t = 1 drafts output[1:], and a round
    there accepts the matches in a row from it."""
    from bench.controller_sim import recorded_runs

    assert recorded_runs([0, 1, 1, 0, 1, 0]) == [2, 1, 0, 1, 0]
    assert recorded_runs([1] * 12)[:3] == [8, 8, 8]  # runs end at 8 (> any cap)
    assert recorded_runs([1, 1]) == [1]


def test_the_recorded_texts_accept_like_their_workloads():
    """`specd bench matches` on the default pair: code's drafts match far more often than
    chat's, and code has all its prompts."""
    from bench.controller_sim import load_traces

    code, chat = load_traces("code"), load_traces("chat")
    assert len(code) == 10 and len(chat) >= 8
    first = statistics.mean(min(r, 1) for t in code for r in t)
    assert first > 0.85 > 0.75 > statistics.mean(min(r, 1) for t in chat for r in t)


def test_auto_keeps_up_with_the_best_fixed_k_on_recorded_code_and_chat():
    """Replayed code (k = 2, 3) and chat (plain, k = 1, 2), with the sweep's warm-up."""
    from bench.controller_sim import load_traces

    for workload, ks in (("code", (2, 3)), ("chat", (0, 1, 2))):
        recorded = load_traces(workload)
        ratios = [
            (r := trial(seed, ks, recorded=recorded))["auto"] / max(r[k] for k in ks)
            for seed in range(8)
        ]
        assert min(ratios) > 0.95, (workload, ratios)
        assert statistics.mean(ratios) > 0.965, (workload, ratios)
