"""One trace per request across router -> verifier -> drafter; metrics move exactly."""

import json
import random
import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from router.client import SpecdClient
from router.policy import Policy
from specd.config import EngineConfig
from tests.cluster import TINY_MODEL_ID, start_cluster
from tests.conftest import wait_for
from tests.integration.openai_api.door import post_json
from tests.integration.test_services import wait_idle
from verifier_service.stats_log import StatsLog


@pytest.fixture(scope="module")
def traced(tiny_pair):
    exporter = InMemorySpanExporter()
    policy = Policy.from_dict({"default": {"min_acceptance": 0.0}, "routes": {"code": {}}})
    engine = EngineConfig(num_blocks=256, block_size=4, prefix_cache="on")  # fp32: auto is off
    c = start_cluster(
        *tiny_pair, policy=policy, span_exporter=exporter, metrics=True, engine_config=engine
    )
    yield c, exporter
    c.close()


def scrape(url: str) -> dict[tuple, float]:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(
                sorted(
                    (k, v)
                    for k, v in s.labels.items()
                    if k not in ("otel_scope_name", "otel_scope_version")
                )
            )
            out[(s.name, labels)] = s.value
    return out


def total(samples: dict, name: str, **labels) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


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


def settle(cluster, condition=lambda: True) -> None:
    """Until the engines and the drafter hold nothing and `condition` holds: what a
    request records after its client has the reply (the router's counters, the drafter's
    session span, ended when the close arrives)."""
    assert wait_idle(cluster)
    wait_for(condition, timeout=10)


def router_requests(cluster) -> float:
    return total(scrape(cluster.metrics_urls["router"]), "specd:requests_total")


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


def test_the_routers_requests_under_vllms_names(traced):
    """The router's requests also under the names vLLM's dashboards read, {model_name}:
    finished requests by finished_reason, prompt and generated tokens (totals and per
    request), time to first token, inter-token latency (one per step after the first),
    time per output token (one per request) and end-to-end latency. A whole (unary)
    reply's steps are timed as they reach the router, not when the reply is sent."""
    cluster, _ = traced
    url = cluster.metrics_urls["router"]
    tiny = {"model_name": "tiny"}
    new = 64
    ask = dict(max_new_tokens=new, ignore_eos=True, route="code")

    def finished(n: int) -> None:
        settle(
            cluster, lambda: router_requests(cluster) == total(before, "specd:requests_total") + n
        )

    def moved(metric, **labels):
        return total(after, metric, **labels, **tiny) - total(before, metric, **labels, **tiny)

    before = scrape(url)
    with SpecdClient(cluster.router) as client:
        whole = client.generate("abc", speculation="off", **ask)
    finished(1)
    after = scrape(url)
    # its 64 steps came one by one: its first token long before its end
    ttft, e2e = (
        moved("vllm:time_to_first_token_seconds_sum"),
        moved("vllm:e2e_request_latency_seconds_sum"),
    )
    itl = moved("vllm:inter_token_latency_seconds_sum")
    assert 0 < ttft < e2e / 2 and e2e / 2 < itl < e2e
    assert moved("vllm:request_time_per_output_token_seconds_sum") * (new - 1) == pytest.approx(itl)

    before = scrape(url)
    with SpecdClient(cluster.router) as client:
        messages = list(client.stream("abcd", speculation="on", **ask))
    finished(1)
    after = scrape(url)
    steps = [m for m in messages if m.token_ids]
    assert 1 < len(steps) < new  # speculation: several tokens in some steps
    assert moved("vllm:inter_token_latency_seconds_count") == len(steps) - 1
    assert moved("vllm:request_success_total", finished_reason="length") == 1
    assert moved("vllm:generation_tokens_total") == new
    assert moved("vllm:request_generation_tokens_sum") == new
    prompt = messages[-1].usage.prompt_tokens
    assert prompt == whole.usage.prompt_tokens + 1 > 1
    assert moved("vllm:prompt_tokens_total") == moved("vllm:request_prompt_tokens_sum") == prompt
    for histogram in (
        "time_to_first_token",
        "request_time_per_output_token",
        "e2e_request_latency",
    ):
        assert moved(f"vllm:{histogram}_seconds_count") == 1
    # the same series as specd's, summed over routes and speculation
    for name in ("time_to_first_token", "time_per_output_token", "e2e_request_latency"):
        ours = f"specd:{name}_seconds_sum"
        theirs = f"vllm:{name.replace('time_per', 'request_time_per')}_seconds_sum"
        assert total(after, ours) == pytest.approx(total(after, theirs, **tiny))


def test_the_routers_requests_under_llama_servers_names(traced):
    """llama-server's `--metrics` series on the router: prompt tokens processed and those
    its prefix cache held, tokens generated, drafts as the verifier told them, the longest
    sequence; throughput over the window since the last scrape (none in the next one);
    requests processing."""
    cluster, _ = traced
    url = cluster.metrics_urls["router"]
    llama = cluster.router_core.metrics.llama
    new = 32
    ask = dict(max_new_tokens=new, ignore_eos=True, route="code", speculation="on")
    predicted = llama.predict.tokens
    with SpecdClient(cluster.router) as client:
        stream = client.stream("xyz", **ask)
        next(stream)  # it runs
        assert total(scrape(url), "llamacpp:requests_processing") == 1
        list(stream)
    # until the router counted it (without scraping it: that would end a window)
    wait_for(lambda: llama.predict.tokens == predicted + new, timeout=10)
    before = scrape(url)  # the window starts here
    predicted = llama.predict.tokens
    with SpecdClient(cluster.router) as client:  # the second finds the first's prompt
        finals = [list(client.stream("abcdefgh" * 3, **ask))[-1] for _ in range(2)]
    wait_for(lambda: llama.predict.tokens == predicted + 2 * new, timeout=10)
    after = scrape(url)

    def moved(name):
        return total(after, f"llamacpp:{name}") - total(before, f"llamacpp:{name}")

    usage, spec = [f.usage for f in finals], [f.speculation for f in finals]
    cached = sum(u.cached_prompt_tokens for u in usage)
    assert cached > 0
    assert moved("prompt_tokens_cached_total") == cached
    assert moved("prompt_tokens_total") == sum(u.prompt_tokens for u in usage) - cached
    assert moved("tokens_predicted_total") == 2 * new
    assert moved("spec_decode_num_drafts_total") == sum(s.rounds for s in spec) > 0
    assert moved("spec_decode_num_draft_tokens_total") == sum(s.drafted for s in spec)
    assert moved("spec_decode_num_accepted_tokens_total") == sum(s.accepted for s in spec)
    assert moved("prompt_seconds_total") > 0 and moved("tokens_predicted_seconds_total") > 0
    assert total(after, "llamacpp:n_tokens_max") >= usage[0].prompt_tokens + new
    # forwards a second: a step's accepted drafts add none, the first token came with the
    # prompt
    steps = sum(new - 1 - s.accepted for s in spec)
    rate = total(after, "llamacpp:predicted_tokens_seconds")
    assert rate == pytest.approx(steps / moved("tokens_predicted_seconds_total"))
    assert total(after, "llamacpp:prompt_tokens_seconds") > 0
    assert total(after, "llamacpp:requests_processing") == 0
    quiet = scrape(url)
    assert total(quiet, "llamacpp:predicted_tokens_seconds") == 0
    assert total(quiet, "llamacpp:prompt_tokens_seconds") == 0


def test_sglangs_server_info_tells_the_mean_accepted_length_since_start(traced):
    """SGLang's /server_info, as sglang.bench_serving reads it: the router's mean tokens a
    drafting round made since start, the same as the verifier's own counts (every
    request here reached the verifier through this router), or since /flush_cache."""
    cluster, _ = traced
    with SpecdClient(cluster.router) as client:
        client.generate("abc", max_new_tokens=24, ignore_eos=True, speculation="on")
    settle(cluster)
    one = {"text": "x", "sampling_params": {"max_new_tokens": 8}, "speculation": "on"}
    assert post_json(f"{cluster.http}/generate", one).status_code == 200
    settle(cluster)
    server = urllib.request.urlopen(f"{cluster.http}/server_info", timeout=5)
    server = json.loads(server.read())
    verifier = scrape(cluster.metrics_urls["verifier0"])
    rounds = total(verifier, "specd:spec_decode_num_drafts_total")
    accepted = total(verifier, "specd:spec_decode_num_accepted_tokens_total")
    (state,) = server["internal_states"]
    assert rounds > 0 and state["avg_spec_accept_length"] == pytest.approx(1 + accepted / rounds)
    assert server["served_model_name"] == TINY_MODEL_ID and server["context_length"] > 0
    # /flush_cache starts it over, as SGLang's does: the next request's rounds alone
    assert urllib.request.urlopen(f"{cluster.http}/flush_cache", timeout=5).status == 200

    def accept_length():
        reply = urllib.request.urlopen(f"{cluster.http}/server_info", timeout=5)
        return json.loads(reply.read())["internal_states"][0]["avg_spec_accept_length"]

    assert accept_length() is None
    out = post_json(f"{cluster.http}/generate", one).json()["meta_info"]
    assert accept_length() == pytest.approx(out["spec_accept_length"])


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


def test_the_endpoint_pickers_gauges_under_vllms_names(traced):
    """What an inference gateway's endpoint picker scrapes from a model server pod (Gateway
    API Inference Extension's model server protocol, vLLM's names): running and waiting
    requests and the KV cache usage as a 0-1 fraction, gauges labelled {model_name}, and
    the cache configuration."""
    cluster, _ = traced
    url = cluster.metrics_urls["verifier0"]

    def families() -> dict:
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        return {f.name: f for f in text_string_to_metric_families(text)}

    def value(fams, name) -> float:
        (sample,) = fams[name].samples
        assert fams[name].type == "gauge" and sample.labels["model_name"] == "tiny"
        return sample.value

    assert wait_idle(cluster)
    with SpecdClient(cluster.router) as client:
        stream = client.stream("abc", max_new_tokens=400, ignore_eos=True, speculation="off")
        next(stream)
        busy = families()
        stream.cancel()
    assert value(busy, "vllm:num_requests_running") == 1
    assert value(busy, "vllm:num_requests_waiting") == 0
    assert 0 < value(busy, "vllm:kv_cache_usage_perc") <= 1
    assert wait_idle(cluster)
    idle = families()
    assert value(idle, "vllm:num_requests_running") == 0
    assert value(idle, "vllm:kv_cache_usage_perc") == 0
    (info,) = idle["vllm:cache_config_info"].samples
    assert info.value == 1
    assert info.labels == {"model_name": "tiny", "block_size": "4", "num_gpu_blocks": "256"}


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
