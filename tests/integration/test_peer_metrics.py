"""The series the dashboards of vLLM, llama-server and SGLang read, served by specd: the
router's requests under vLLM's and llama-server's names, SGLang's /server_info, and what an
inference gateway's endpoint picker scrapes from a verifier."""

import json
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.client import SpecdClient
from tests.cluster import TINY_MODEL_ID
from tests.conftest import wait_for
from tests.integration.conftest import router_requests, scrape, settle, total
from tests.integration.openai_api.door import post_json
from tests.integration.test_services import wait_idle


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
