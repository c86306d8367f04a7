"""The router's decision at arrival: hard bounds final, soft ones left to the verifier."""

from pathlib import Path

import pytest

from router.policy import Decision, Load, Policy, RoutePolicy, decide

AUTO = RoutePolicy(speculation="auto", num_draft_tokens=4, max_batch_size=8)


def test_batch_and_kv_at_arrival_are_reported_not_final():
    # the verifier applies the batch and KV bounds per step, so an auto request keeps its
    # k: it drafts once the batch drains or the cache empties
    assert decide(AUTO, "auto", 0.0, Load(running=12)) == Decision(4, True, "off:batch")
    full = Load(kv_utilization=0.99)
    assert decide(AUTO, "auto", 0.0, full) == Decision(4, True, "off:kv")
    assert decide(AUTO, "auto", 0.0, Load(running=2)) == Decision(4, True, "auto")


@pytest.mark.parametrize(
    "policy,client,temperature,load,expected",
    [
        (AUTO, "on", 0.0, Load(running=12), Decision(4, False, "on")),  # forced: fixed k
        (RoutePolicy(speculation="on"), "auto", 0.0, Load(), Decision(4, False, "on")),
        (AUTO, "off", 0.0, Load(), Decision(0, False, "off:client")),
        (RoutePolicy(speculation="off"), "on", 0.0, Load(), Decision(0, False, "off:policy")),
        (RoutePolicy(max_batch_size=0), "auto", 0.0, Load(), Decision(0, False, "off:batch")),
        (
            AUTO,
            "auto",
            0.0,
            Load(drafter_available=False),
            Decision(0, False, "off:drafter-unavailable"),
        ),
        (AUTO, "auto", 2.0, Load(), Decision(0, False, "off:temperature")),
    ],
)
def test_hard_bounds_are_final_at_arrival(policy, client, temperature, load, expected):
    assert decide(policy, client, temperature, load) == expected


@pytest.mark.parametrize("path", ["deploy/policy.yaml", "deploy/k8s/base/policy.yaml"])
def test_the_shipped_policy_files_are_the_builtin_policy(path):
    root = Path(__file__).resolve().parents[2]
    assert Policy.load(str(root / path)) == Policy.builtin()
    assert Policy.builtin().for_route("edit")[1].num_draft_tokens == 8
