"""One trace per request across router -> verifier -> drafter; metrics move exactly."""

import random
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from router.client import SpecdClient
from tests.cluster import TINY_MODEL_ID
from tests.integration.conftest import router_requests, scrape, settle, total
from tests.integration.openai_api.door import post_json
from tests.integration.test_services import wait_idle
from verifier_service.stats_log import StatsLog


def test_one_trace_across_three_services(traced):
    cluster, exporter = traced
    exporter.clear()
    with SpecdClient(cluster.router) as client:
        r = client.generate(
            "hello world", max_new_tokens=12, ignore_eos=True, speculation="on", route=""
        )
    assert r.speculation.enabled
    finished = lambda: {s.name for s in exporter.get_finished_spans()}  # noqa: E731
    settle(cluster, lambda: "specd.drafter.session" in finished())
    spans = {s.name: s for s in exporter.get_finished_spans()}
    root = spans["specd.router.generate"]
    decide = spans["specd.router.decide"]
    verify = spans["specd.verifier.generate"]
    session = spans["specd.drafter.session"]
    trace_id = root.context.trace_id
    for s in (
        decide,
        verify,
        session,
        spans["specd.verifier.queue"],
        spans["specd.verifier.prefill"],
    ):
        assert s.context.trace_id == trace_id, s.name
    assert root.parent is None
    assert decide.parent.span_id == root.context.span_id
    assert verify.parent.span_id == root.context.span_id
    assert session.parent.span_id == verify.context.span_id
    assert spans["specd.verifier.queue"].parent.span_id == verify.context.span_id
    assert decide.attributes["specd.speculation.reason"] == "on"
    rounds = [e for e in verify.events if e.name == "speculation.round"]
    assert len(rounds) == r.speculation.rounds > 0
    steps = [s for s in exporter.get_finished_spans() if s.name == "specd.engine.step"]
    assert steps and all(s.parent is None or s.context.trace_id != trace_id for s in steps)
    assert any(link.context.span_id == verify.context.span_id for s in steps for link in s.links)


def test_metrics_move_by_exactly_the_expected_amounts(traced):
    cluster, _ = traced
    urls = cluster.metrics_urls
    before = {name: scrape(url) for name, url in urls.items()}
    requests_before = total(before["router"], "specd:requests_total")
    n, new = 3, 10
    results = []
    with SpecdClient(cluster.router) as client:
        for i in range(n):
            results.append(
                client.generate(
                    f"abc{i}", max_new_tokens=new, ignore_eos=True, speculation="on", route="code"
                )
            )
        off = client.generate(
            "xyz", max_new_tokens=new, ignore_eos=True, speculation="off", route="code"
        )
    settle(cluster, lambda: router_requests(cluster) == requests_before + n + 1)
    after = {name: scrape(url) for name, url in urls.items()}

    def moved(service, metric, **labels):
        return total(after[service], metric, **labels) - total(before[service], metric, **labels)

    rounds = sum(r.speculation.rounds for r in results)
    drafted = sum(r.speculation.drafted for r in results)
    accepted = sum(r.speculation.accepted for r in results)
    assert moved("router", "specd:requests_total", route="code") == n + 1
    assert moved("router", "specd:speculation_decisions_total", route="code", reason="on") == n
    assert (
        moved("router", "specd:speculation_decisions_total", route="code", reason="off:client") == 1
    )
    assert moved("router", "specd:generation_tokens_total", route="code") == (n + 1) * new
    assert moved("router", "specd:time_to_first_token_seconds_count", route="code") == n + 1
    assert (
        moved("router", "specd:time_per_output_token_seconds_count", route="code", speculation="on")
        == n
    )
    v = "verifier0"
    assert moved(v, "specd:generation_tokens_total", route="code") == (n + 1) * new
    assert moved(v, "specd:spec_decode_num_drafts_total", route="code") == rounds
    assert moved(v, "specd:spec_decode_num_draft_tokens_total", route="code") == drafted
    assert moved(v, "specd:spec_decode_num_accepted_tokens_total", route="code") == accepted
    lookups = sum(r.speculation.lookup_rounds for r in results)
    assert moved(v, "specd:spec_decode_num_lookup_drafts_total", route="code") == lookups
    assert moved(v, "specd:spec_decode_num_accepted_tokens_per_pos_total", route="code") == accepted
    # and under vLLM's names, {model_name}, summed over routes (the only route here: code)
    tiny = {"model_name": "tiny"}
    assert moved(v, "vllm:spec_decode_num_drafts_total", **tiny) == rounds
    assert moved(v, "vllm:spec_decode_num_draft_tokens_total", **tiny) == drafted
    assert moved(v, "vllm:spec_decode_num_accepted_tokens_total", **tiny) == accepted
    per_pos = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    assert moved(v, per_pos, **tiny) == accepted
    assert moved(v, per_pos, position="0", **tiny) == moved(
        v, "specd:spec_decode_num_accepted_tokens_per_pos_total", route="code", position="0"
    )
    # each request's phases on the verifier, as vLLM times them: inference = prefill + decode
    for phase in ("queue", "prefill", "decode", "inference"):
        assert moved(v, f"specd:request_{phase}_time_seconds_count", route="code") == n + 1
        assert moved(v, f"vllm:request_{phase}_time_seconds_count", **tiny) == n + 1
    phase = lambda name: moved(v, f"vllm:request_{name}_time_seconds_sum", **tiny)  # noqa: E731
    assert phase("prefill") + phase("decode") == pytest.approx(phase("inference"))
    assert phase("queue") >= 0 and phase("prefill") > 0 and phase("decode") > 0
    e2e = moved("router", "specd:e2e_request_latency_seconds_sum", route="code")
    assert phase("queue") + phase("inference") < e2e
    assert moved(v, "specd:drafter_round_trip_seconds_count") >= rounds
    assert moved("drafter", "specd:drafter_rounds_total") >= rounds
    assert total(after[v], "specd:kv_cache_usage_perc") == 0.0
    assert 0.25 <= total(after[v], "specd:speculation_step_pace") <= 4.0
    # every step is planned and observed, outside the step's own time
    control = moved(v, "specd:speculation_control_seconds_total")
    assert 0.0 < control < moved(v, "specd:engine_step_seconds_total")
    assert off.speculation.rounds == 0


def test_the_steps_auto_priced_are_exported_with_what_they_did(traced):
    """The speculation control's priced steps (Engine.priced) as the verifier's metrics:
    an `auto` request's decode steps, what the control expected of them and what they
    emitted and took (no more than the request's tokens, no longer than the steps)."""
    cluster, _ = traced
    url = cluster.metrics_urls["verifier0"]
    before = scrape(url)
    with SpecdClient(cluster.router) as client:
        client.generate("priced", max_new_tokens=16, ignore_eos=True, speculation="auto")
    settle(cluster)
    after = scrape(url)

    def moved(metric):
        return total(after, metric) - total(before, metric)

    steps = moved("specd:speculation_priced_steps_total")
    assert 0 < steps <= moved("specd:speculation_priced_tokens_total") <= 16
    assert moved("specd:speculation_priced_expected_tokens_total") >= steps
    assert (
        0
        < moved("specd:speculation_priced_seconds_total")
        <= moved("specd:engine_step_seconds_total")
    )
    assert moved("specd:speculation_priced_expected_seconds_total") > 0


def test_a_repeated_prompt_counts_as_prefix_cache_hits(traced):
    """The verifier counts its cache's hits; the router, how prefix affinity chose."""
    cluster, _ = traced
    url, router = cluster.metrics_urls["verifier0"], cluster.metrics_urls["router"]
    before, routed = scrape(url), scrape(router)
    with SpecdClient(cluster.router) as client:
        for _ in range(2):
            client.generate("the same prompt, twice", max_new_tokens=4, speculation="off")
    settle(cluster)
    after = scrape(url)
    choices = scrape(router)
    affinity = "specd:router_prefix_affinity_total"
    for outcome in ("new", "cached"):
        key = (affinity, (("outcome", outcome),))
        assert choices.get(key, 0) - routed.get(key, 0) == 1, outcome

    def moved(metric):
        return total(after, metric) - total(before, metric)

    queries, hits = (
        moved("specd:prefix_cache_queries_total"),
        moved("specd:prefix_cache_hits_total"),
    )
    # both look up all but their last token; the second finds every whole block of 4
    assert queries > 8 and queries % 2 == 0
    assert hits == (queries // 2) // 4 * 4
    assert moved("vllm:prefix_cache_queries_total") == queries  # as vLLM names them
    assert moved("vllm:prefix_cache_hits_total") == hits


def test_http_requests_are_traced_and_counted(traced):
    import openai

    cluster, exporter = traced
    exporter.clear()
    before = scrape(cluster.metrics_urls["router"])
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    headers = {"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01", "x-route": "code"}
    with openai.OpenAI(base_url=f"{cluster.http}/v1", api_key="-", max_retries=0) as client:
        client.completions.create(
            model=TINY_MODEL_ID,
            prompt="abc",
            max_tokens=6,
            extra_headers=headers,
            extra_body={"ignore_eos": True, "speculation": "on"},
        )
    settle(cluster, lambda: router_requests(cluster) == total(before, "specd:requests_total") + 1)
    after = scrape(f"{cluster.http}/metrics")  # the HTTP door serves the router's metrics too
    assert after == scrape(cluster.metrics_urls["router"])
    spans = {s.name: s for s in exporter.get_finished_spans()}
    root, verify = spans["specd.router.generate"], spans["specd.verifier.generate"]
    assert format(root.context.trace_id, "032x") == trace_id  # the caller's trace continues
    assert verify.context.trace_id == root.context.trace_id
    assert root.attributes["specd.route"] == "code"

    def moved(metric, **labels):
        return total(after, metric, **labels) - total(before, metric, **labels)

    assert moved("specd:requests_total", route="code") == 1
    assert moved("specd:generation_tokens_total", route="code") == 6
    assert moved("specd:time_to_first_token_seconds_count", route="code") == 1


def test_the_verifiers_stats_lines_say_what_ran(traced):
    """The verifier's periodic log lines (vLLM's): nothing while idle; after two requests,
    their tokens, no request left running, and their speculation counted exactly."""

    cluster, _ = traced
    servicer, engine = cluster.verifier_servicers[0], cluster.engines[0]
    assert len(cluster.verifiers) == 1 and wait_idle(cluster)
    stats = StatsLog(engine, interval=60)
    assert stats.lines() == []  # idle: nothing to say
    servicer.stats_log = stats
    try:
        with SpecdClient(cluster.router) as client:
            ask = dict(max_new_tokens=24, ignore_eos=True, speculation="on")
            done = [client.generate(p, **ask) for p in ("abc", "hello there")]
        settle(cluster)
        rounds = sum(r.speculation.rounds for r in done)
        accepted = sum(r.speculation.accepted for r in done)
        drafted = sum(r.speculation.drafted for r in done)
        prompts = sum(r.usage.prompt_tokens for r in done)
        counted = (stats.tokens, stats.prompt_tokens, stats.drafts, stats.accepted, stats.drafted)
        assert counted == (48, prompts, rounds, accepted, drafted)
        lines = stats.lines()
    finally:
        servicer.stats_log = None
    assert stats.lines() == []  # the counts started again, and nothing ran since
    load, spec = lines
    assert "Running: 0 reqs, Waiting: 0 reqs, KV cache usage: 0.0%" in load
    assert float(re.search(r"generation throughput: ([\d.]+) tokens/s", load)[1]) > 0
    assert f"Accepted: {accepted} tokens, Drafted: {drafted} tokens" in spec
    assert f"Mean acceptance length: {1 + accepted / rounds:.2f}" in spec
    rates = re.search(r"Per-position acceptance rate: ([\d., ]+),", spec)[1].split(", ")
    assert sum(float(x) for x in rates) * rounds == pytest.approx(accepted, abs=0.01 * rounds)


def test_preemptions_are_counted_under_both_names_and_change_no_output(traced):
    """Four requests that together outgrow the KV pool (256 blocks of 4: each alone fits)
    preempt one another; the verifier counts each preemption, as specd's counter and as
    vLLM's `vllm:num_preemptions_total`, and greedy output with speculation stays what
    each request decodes alone. A request alone preempts nothing."""
    cluster, _ = traced
    url = cluster.metrics_urls["verifier0"]
    prompts = ["abc", "hello there", "the quick brown fox", "one two three"]
    ask = dict(max_new_tokens=300, ignore_eos=True, speculation="on")
    assert wait_idle(cluster)
    before = scrape(url)
    with SpecdClient(cluster.router) as client:
        alone = [client.generate(p, **ask).token_ids for p in prompts]
        settle(cluster)
        assert total(scrape(url), "specd:num_preemptions_total") == total(
            before, "specd:num_preemptions_total"
        )
        with ThreadPoolExecutor(len(prompts)) as pool:
            together = list(pool.map(lambda p: client.generate(p, **ask).token_ids, prompts))
    settle(cluster)
    after = scrape(url)
    assert together == alone and all(len(ids) == 300 for ids in together)
    preempted = total(after, "specd:num_preemptions_total") - total(
        before, "specd:num_preemptions_total"
    )
    assert preempted > 0
    key = ("vllm:num_preemptions_total", (("model_name", "tiny"),))
    assert after[key] - before[key] == preempted


def test_the_usage_tells_the_prompt_tokens_found_cached(traced):
    """A prompt sent again is found in the verifier's prefix cache: the usage says how
    much of it (whole blocks, the last prompt token always computed), on the OpenAI door
    (prompt_tokens_details) as on llama-server's (tokens_cached); the first time, none."""
    c, _ = traced
    prompt = "".join(random.choice("abcdefgh") for _ in range(41))
    body = {"model": TINY_MODEL_ID, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    first = post_json(f"{c.http}/v1/completions", body).json()["usage"]
    assert first["prompt_tokens"] == 41
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    again = post_json(f"{c.http}/v1/completions", body).json()["usage"]
    assert again["prompt_tokens_details"] == {"cached_tokens": 40}  # 10 blocks of 4
    llama = post_json(f"{c.http}/completion", {"prompt": prompt, "n_predict": 2}).json()
    assert llama["tokens_cached"] == 40 and llama["timings"]["prompt_n"] == 1
