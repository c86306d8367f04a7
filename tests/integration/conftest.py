"""What the telemetry tests share (test_telemetry.py, test_peer_metrics.py): a tiny
cluster with tracing and metrics on, each module its own, and reading its metrics."""

import urllib.request

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from router.policy import Policy
from specd.config import EngineConfig
from tests.cluster import start_cluster
from tests.conftest import wait_for
from tests.integration.test_services import wait_idle


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


def settle(cluster, condition=lambda: True) -> None:
    """Until the engines and the drafter hold nothing and `condition` holds: what a
    request records after its client has the reply (the router's counters, the drafter's
    session span, ended when the close arrives)."""
    assert wait_idle(cluster)
    wait_for(condition, timeout=10)


def router_requests(cluster) -> float:
    return total(scrape(cluster.metrics_urls["router"]), "specd:requests_total")
