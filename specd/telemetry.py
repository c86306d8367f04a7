"""Telemetry for the three services: OpenTelemetry tracing, Prometheus metrics, and every
metric name in one place.

Tracing is off unless the standard OTEL_* environment asks for it (OTEL_TRACES_EXPORTER,
OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT); off means the API's
no-op tracer: no spans are built. Context travels in gRPC metadata (W3C traceparent).
Metrics are prometheus_client's own, named as vLLM names its (`specd:...`), served on a
scrape endpoint per service (`--metrics-port`), one registry per service so several
services can share a process (tests). With metrics off they are created unregistered:
the calls stay the same and nothing is served.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field

import prometheus_client
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

# -- metric names (vLLM's where they exist) --------------------------------------------------
REQUESTS = "specd:requests"  # router, {route, finish_reason}
DECISIONS = "specd:speculation_decisions"  # router, {route, reason}
TTFT = "specd:time_to_first_token_seconds"  # router, {route}
TPOT = "specd:time_per_output_token_seconds"  # router, {route, speculation}
E2E = "specd:e2e_request_latency_seconds"  # router, {route}
# router, {outcome}: how prefix affinity chose a replica (cached: one it sent the prompt's
# prefix to; busy: those were too busy, the least loaded; new: none was sent its prefix)
PREFIX_AFFINITY = "specd:router_prefix_affinity"
TOKENS_OUT = "specd:generation_tokens"  # router and verifier, {route}
PROMPT_TOKENS = "specd:prompt_tokens"  # router, {route}
REQUEST_PROMPT_TOKENS = "specd:request_prompt_tokens"  # router histogram {route}: per request
REQUEST_TOKENS_OUT = "specd:request_generation_tokens"  # router histogram {route}: per request
# router histogram {route}: between a request's successive steps' tokens reaching the router
ITL = "specd:inter_token_latency_seconds"
# verifier histograms {route}, a finished request's phases: arrival to its first prefill
# chunk (queue), to its first token (prefill), to its last (decode); prefill + decode
QUEUE_TIME = "specd:request_queue_time_seconds"
PREFILL_TIME = "specd:request_prefill_time_seconds"
DECODE_TIME = "specd:request_decode_time_seconds"
INFERENCE_TIME = "specd:request_inference_time_seconds"
NUM_DRAFTS = "specd:spec_decode_num_drafts"  # verifier, {route}
NUM_DRAFT_TOKENS = "specd:spec_decode_num_draft_tokens"  # verifier, {route}
NUM_ACCEPTED = "specd:spec_decode_num_accepted_tokens"  # verifier, {route}
LOOKUP_DRAFTS = "specd:spec_decode_num_lookup_drafts"  # verifier, {route}: no model ran
ACCEPTED_PER_POS = "specd:spec_decode_num_accepted_tokens_per_pos"  # {route, position}
SPEC_K = "specd:speculation_chosen_k"  # verifier histogram {route}: k per decode step (0: plain)
SPEC_GAIN = "specd:speculation_predicted_gain"  # verifier histogram {route}: tokens/s vs plain
SPEC_DECISIONS = "specd:speculation_step_decisions"  # verifier counter {route, reason}
SPEC_PACE = "specd:speculation_step_pace"  # verifier gauge: steps' speed vs the prices held
KV_USAGE = "specd:kv_cache_usage_perc"  # verifier gauge, 0..1
RUNNING = "specd:num_requests_running"  # verifier gauge
WAITING = "specd:num_requests_waiting"  # verifier gauge
PREFIX_QUERIES = "specd:prefix_cache_queries"  # verifier counter: prompt tokens looked up
PREFIX_HITS = "specd:prefix_cache_hits"  # verifier counter: of which found cached
PREEMPTIONS = "specd:num_preemptions"  # verifier counter: sequences preempted for KV room
STEP_SECONDS = "specd:engine_step_seconds"  # verifier counter: seconds in steps
CONTROL_SECONDS = "specd:speculation_control_seconds"  # verifier counter: waits on plan/observe
# verifier counters: decode steps the control priced, what it expected of them, what they did
SPEC_PRICED_STEPS = "specd:speculation_priced_steps"
SPEC_EXPECTED_TOKENS = "specd:speculation_priced_expected_tokens"
SPEC_PRICED_TOKENS = "specd:speculation_priced_tokens"
SPEC_EXPECTED_SECONDS = "specd:speculation_priced_expected_seconds"
SPEC_PRICED_SECONDS = "specd:speculation_priced_seconds"
DRAFTER_RTT = "specd:drafter_round_trip_seconds"  # verifier histogram
DRAFTER_FALLBACKS = "specd:drafter_fallbacks"  # verifier: rounds decoded with k = 0
DRAFTER_PUSHED = "specd:drafter_pushed_rounds"  # verifier: drafted from a push, no round trip
# verifier: drafted from a round asked as the step before ended (RemoteProposer.prefetch)
DRAFTER_PREFETCHED = "specd:drafter_prefetched_rounds"
# verifier: drafted by its own lookup where a combined drafter would look up first
DRAFTER_LOOKED_UP = "specd:drafter_looked_up_rounds"
DRAFTER_SESSIONS = "specd:drafter_sessions"  # drafter gauge
DRAFTER_ROUNDS = "specd:drafter_rounds"  # drafter counter
# the verifier's load under the names an inference gateway's endpoint picker scrapes from
# a vLLM pod (Gateway API Inference Extension, llm-d), labelled {model_name}
VLLM_RUNNING = "vllm:num_requests_running"  # gauge
VLLM_WAITING = "vllm:num_requests_waiting"  # gauge
VLLM_KV_USAGE = "vllm:kv_cache_usage_perc"  # gauge, a 0..1 fraction as vLLM's
VLLM_CACHE_CONFIG = "vllm:cache_config_info"  # gauge = 1, {block_size, num_gpu_blocks}
VLLM_PREEMPTIONS = "vllm:num_preemptions"  # counter (served as ..._total)
# specd's series under the names vLLM's dashboards read (Telemetry.view), {model_name}:
# the verifier's speculation and prefix cache ...
VLLM_NUM_DRAFTS = "vllm:spec_decode_num_drafts"
VLLM_NUM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
VLLM_NUM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
VLLM_ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"  # {position}
VLLM_PREFIX_QUERIES = "vllm:prefix_cache_queries"
VLLM_PREFIX_HITS = "vllm:prefix_cache_hits"
VLLM_QUEUE_TIME = "vllm:request_queue_time_seconds"
VLLM_PREFILL_TIME = "vllm:request_prefill_time_seconds"
VLLM_DECODE_TIME = "vllm:request_decode_time_seconds"
VLLM_INFERENCE_TIME = "vllm:request_inference_time_seconds"
# ... and the router's requests, as its clients saw them
VLLM_SUCCESS = "vllm:request_success"  # {finished_reason}
VLLM_PROMPT_TOKENS = "vllm:prompt_tokens"
VLLM_TOKENS_OUT = "vllm:generation_tokens"
VLLM_REQUEST_PROMPT_TOKENS = "vllm:request_prompt_tokens"
VLLM_REQUEST_TOKENS_OUT = "vllm:request_generation_tokens"
VLLM_TTFT = "vllm:time_to_first_token_seconds"
VLLM_ITL = "vllm:inter_token_latency_seconds"
VLLM_TPOT = "vllm:request_time_per_output_token_seconds"  # one per request, as specd's TPOT
VLLM_E2E = "vllm:e2e_request_latency_seconds"

K_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16)
GAIN_BUCKETS = (0.8, 0.9, 1.0, 1.05, 1.1, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0)
TOKEN_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5))  # 1 to 5M, as vLLM's
LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    3.0,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
)


def tracing_requested() -> bool:
    env = os.environ
    exporter = env.get("OTEL_TRACES_EXPORTER", "")
    if exporter == "none":
        return False
    return bool(
        exporter
        or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


@dataclass
class Telemetry:
    service: str
    tracer: trace.Tracer
    registry: prometheus_client.CollectorRegistry | None = None  # None: metrics off
    _metrics: dict = field(default_factory=dict)

    @property
    def tracing(self) -> bool:
        return not isinstance(self.tracer, trace.NoOpTracer)

    def counter(self, name: str, description: str, labels: tuple[str, ...] = ()):
        return self._get(prometheus_client.Counter, name, description, labels)

    def histogram(self, name: str, description: str, labels: tuple[str, ...] = ()):
        buckets = {
            SPEC_K: K_BUCKETS,
            SPEC_GAIN: GAIN_BUCKETS,
            REQUEST_PROMPT_TOKENS: TOKEN_BUCKETS,
            REQUEST_TOKENS_OUT: TOKEN_BUCKETS,
        }.get(name, LATENCY_BUCKETS)
        return self._get(prometheus_client.Histogram, name, description, labels, buckets=buckets)

    def gauge(self, name: str, read, description: str, labels: dict[str, str] | None = None):
        """A gauge whose value is `read()` at each scrape (one series: `labels`' values)."""
        labels = labels or {}
        gauge = self._get(prometheus_client.Gauge, name, description, tuple(labels))
        (gauge.labels(**labels) if labels else gauge).set_function(read)
        return gauge

    def total(self, name: str, read, description: str, labels: dict[str, str] | None = None):
        """A counter whose value is `read()` at each scrape: a total the service keeps
        itself (served as NAME_total, one series: `labels`' values)."""
        if self.registry is not None and name not in self._metrics:
            self._metrics[name] = _ReadTotal(name, read, description, labels or {})
            self.registry.register(self._metrics[name])

    def view(self, name: str, source, labels: dict[str, str], by: dict[str, str] | None = None):
        """`source` (a counter or histogram of this registry) served also as `name`: summed
        over its labels but those in `by` (renamed to by's values), `labels` added. Read
        at each scrape: nothing is counted twice."""
        if self.registry is not None and name not in self._metrics:
            self._metrics[name] = _View(name, source, labels, by or {})
            self.registry.register(self._metrics[name])

    def _get(self, kind, name, description, labels, **options):
        if name not in self._metrics:
            self._metrics[name] = kind(name, description, labels, registry=self.registry, **options)
        return self._metrics[name]


class _ReadTotal:
    """A prometheus_client collector serving one counter read from its owner."""

    def __init__(self, name: str, read, description: str, labels: dict[str, str]):
        self.name, self.read, self.description, self.labels = name, read, description, labels

    def _family(self):
        return CounterMetricFamily(self.name, self.description, labels=tuple(self.labels))

    def describe(self):  # what the registry checks names against: no read at registration
        yield self._family()

    def collect(self):
        family = self._family()
        family.add_metric(tuple(self.labels.values()), self.read())
        yield family


class _View:
    """A prometheus_client collector serving another metric's series under a new name
    (Telemetry.view)."""

    def __init__(self, name: str, source, labels: dict[str, str], by: dict[str, str]):
        self.name, self.source, self.labels, self.by = name, source, labels, by
        self.histogram = isinstance(source, prometheus_client.Histogram)
        self.names = (*by.values(), *labels)
        (described,) = source.describe()
        self.description = described.documentation

    def _family(self):
        kind = HistogramMetricFamily if self.histogram else CounterMetricFamily
        return kind(self.name, self.description, labels=self.names)

    def describe(self):
        yield self._family()

    def collect(self):
        sums: dict[tuple, float] = defaultdict(float)  # counter: its total; histogram: _sum
        buckets: dict[tuple, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        for metric in self.source.collect():
            for s in metric.samples:
                key = (*(s.labels[k] for k in self.by), *self.labels.values())
                if s.name.endswith("_bucket"):
                    buckets[key][s.labels["le"]] += s.value
                elif s.name.endswith(("_total", "_sum")):
                    sums[key] += s.value
        family = self._family()
        for key, value in sums.items():
            if self.histogram:  # cumulative counts, summed bucket by bucket
                ordered = sorted(buckets[key].items(), key=lambda b: float(b[0]))
                family.add_metric(key, ordered, value)
            else:
                family.add_metric(key, value)
        yield family


def setup(
    service: str, metrics_port: int = 0, span_exporter=None, metrics: bool | None = None
) -> Telemetry:
    """Telemetry for one service. `span_exporter` (tests) forces tracing on with it;
    `metrics` defaults to on when a port is given (port 0 with metrics=True: no server,
    but the registry can still be read)."""
    resource = Resource.create({"service.name": f"specd-{service}"})
    if span_exporter is not None:
        provider = TracerProvider(resource=resource)
        provider.add_span_processor(SimpleSpanProcessor(span_exporter))
        tracer = provider.get_tracer("specd")
    elif tracing_requested():
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider = TracerProvider(resource=resource)
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        tracer = provider.get_tracer("specd")
    else:
        tracer = trace.NoOpTracer()

    registry = None
    if metrics or (metrics is None and metrics_port):
        prometheus_client.disable_created_metrics()  # no *_created series (as vLLM)
        registry = prometheus_client.CollectorRegistry()
        if metrics_port:
            prometheus_client.start_http_server(metrics_port, registry=registry)
    return Telemetry(service, tracer, registry)


# -- context in gRPC metadata ------------------------------------------------------------------
def inject_metadata(context=None) -> list[tuple[str, str]]:
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=context)
    return list(carrier.items())


def extract_metadata(metadata) -> object:
    return propagate.extract({k: v for k, v in (metadata or ()) if isinstance(v, str)})
