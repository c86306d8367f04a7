"""Replica discovery by DNS and policy reload, with in-process verifiers."""

import time

import pytest

from router.client import SpecdClient
from router.discovery import DnsDiscovery
from router.policy import PolicyFile
from tests.cluster import start_cluster


@pytest.fixture(scope="module")
def two(tiny_pair):
    c = start_cluster(*tiny_pair, replicas=2)
    yield c
    c.close()


def served(cluster) -> list[int]:
    return [s.requests_started for s in cluster.verifier_servicers]


def test_dns_answers_move_traffic(two):
    a, b = two.verifiers
    answers = {"verifiers:1": [a]}

    async def fake_resolve(name):
        return list(answers[name])

    discovery = DnsDiscovery(two.replicas, ["verifiers:1"], resolve=fake_resolve)

    def send(n):
        before = served(two)
        with SpecdClient(two.router) as client:
            for _ in range(n):
                client.generate("abc", max_new_tokens=4, ignore_eos=True, speculation="off")
        return [x - y for x, y in zip(served(two), before, strict=True)]

    for answer, expect in (([a], [True, False]), ([a, b], [True, True]), ([b], [False, True])):
        answers["verifiers:1"] = answer
        assert sorted(two.run(discovery.refresh())) == sorted(answer)
        deadline = time.monotonic() + 5
        while not all(two.replicas.replicas[x].healthy for x in answer):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        counts = send(6)
        assert [c > 0 for c in counts] == expect, counts


def test_policy_reload_applies_to_the_next_request(two, tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_text("routes:\n  code: {num_draft_tokens: 2}\n")
    servicer = two.router_core.preparer
    old = servicer.policy
    servicer.policy = PolicyFile(str(path))
    try:
        with SpecdClient(two.router) as client:
            r = client.generate("abc", max_new_tokens=3, route="code", speculation="on")
            assert r.speculation.num_draft_tokens == 2
            path.write_text("routes:\n  code: {speculation: 'off'}\n")
            r = client.generate("abc", max_new_tokens=3, route="code")
            assert r.speculation.reason == "off:policy"
            path.write_text("routes: [not, a, mapping")  # broken: the last good one stays
            r = client.generate("abc", max_new_tokens=3, route="code")
            assert r.speculation.reason == "off:policy"
    finally:
        servicer.policy = old
