"""The router's decision and the verifier-side batch gate for `auto` requests."""

from pathlib import Path

import pytest

from router.policy import Load, Policy, RoutePolicy, batch_gate, decide

AUTO = RoutePolicy(speculation="auto", num_draft_tokens=4, max_batch_size=8)


def test_a_request_refused_only_for_the_batch_is_gated_not_refused():
    busy = Load(running=12)
    assert decide(AUTO, "auto", 0.0, busy) == (0, "off:batch")
    assert batch_gate(AUTO, "auto", 0.0, busy) == 8  # drafts once fewer than 8 run
    assert decide(AUTO, "auto", 0.0, Load(running=2)) == (4, "on")
    assert batch_gate(AUTO, "auto", 0.0, Load(running=2)) == 8  # and stops above 8


@pytest.mark.parametrize(
    "policy,client,temperature,load",
    [
        (AUTO, "on", 0.0, Load(running=12)),  # forced on: no gate
        (AUTO, "off", 0.0, Load()),
        (RoutePolicy(speculation="on"), "auto", 0.0, Load()),
        (RoutePolicy(max_batch_size=0), "auto", 0.0, Load()),  # the route never speculates
        (AUTO, "auto", 0.0, Load(running=12, kv_utilization=0.99)),  # refused for KV too
        (AUTO, "auto", 0.0, Load(running=12, route_acceptance=0.1)),
        (AUTO, "auto", 0.0, Load(running=12, drafter_available=False)),
        (AUTO, "auto", 2.0, Load(running=12)),  # too hot
    ],
)
def test_no_gate_where_anything_but_the_batch_says_no(policy, client, temperature, load):
    assert batch_gate(policy, client, temperature, load) == 0


@pytest.mark.parametrize("path", ["deploy/policy.yaml", "deploy/k8s/base/policy.yaml"])
def test_the_shipped_policy_files_are_the_builtin_policy(path):
    root = Path(__file__).resolve().parents[2]
    assert Policy.load(str(root / path)) == Policy.builtin()
    assert Policy.builtin().for_route("edit")[1].num_draft_tokens == 8
