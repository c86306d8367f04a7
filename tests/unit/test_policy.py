"""The route policy: typed parsing (bad files refused naming the field, the last good
policy kept on reload) and the decision at arrival (hard bounds final, soft ones left to
the verifier)."""

import logging
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from router import policy as router_policy
from router.decide import Decision, Load, decide
from router.policy import Policy, PolicyError, PolicyFile, RoutePolicy

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


def test_a_prediction_speculates_without_a_drafter():
    alone = Load(drafter_available=False)
    assert decide(AUTO, "auto", 0.0, alone, predicted=True) == Decision(4, True, "auto")
    assert decide(AUTO, "off", 0.0, alone, predicted=True) == Decision(0, False, "off:client")


@pytest.mark.parametrize("path", ["deploy/policy.yaml", "deploy/k8s/base/policy.yaml"])
def test_the_shipped_policy_files_are_the_builtin_policy(path):
    root = Path(__file__).resolve().parents[2]
    assert Policy.load(str(root / path)) == Policy.builtin()
    assert Policy.builtin().for_route("edit")[1].num_draft_tokens == 8


def test_an_unknown_route_is_served_by_default_with_a_warning_of_bounded_size():
    route, _, warning = Policy.builtin().for_route("nope")
    assert route == "default" and warning == "unknown route 'nope'; used 'default'"
    route, _, warning = Policy.builtin().for_route("r" * 1_000_000)
    assert route == "default" and "r" * 64 + "..." in warning and len(warning) < 120


@pytest.mark.parametrize(
    "text,field",
    [
        ("default: {num_draft_tokens: '6'}", "default.num_draft_tokens"),  # a string
        ("default: {num_draft_tokens: 6.5}", "default.num_draft_tokens"),  # not an integer
        ("routes: {code: {max_batch_size: -1}}", "routes.code.max_batch_size"),
        ("routes: {code: {max_kv_utilization: .nan}}", "routes.code.max_kv_utilization"),
        ("routes: {code: {min_acceptance: 1.5}}", "routes.code.min_acceptance"),
        ("routes: {code: {max_temperature: .inf}}", "routes.code.max_temperature"),
        ("routes: {code: {speculation: maybe}}", "routes.code.speculation"),
        ("routes: {code: {num_draft_token: 6}}", "routes.code.num_draft_token"),  # typo
        ("defaults: {num_draft_tokens: 6}", "defaults"),  # unknown key
        ("routes: [code]", "routes"),
    ],
)
def test_a_bad_policy_is_refused_naming_the_field(text, field):
    with pytest.raises(PolicyError, match=rf"^{re.escape(field)}: "):
        Policy.from_yaml(text)


def test_off_and_on_work_as_users_write_them():
    # YAML reads bare off/on as booleans; the module docstring's example must load
    policy = Policy.from_yaml(textwrap.dedent(router_policy.__doc__.split("\n\n")[1]))
    assert policy.routes["batch"].speculation == "off"
    assert Policy.from_yaml("routes: {a: {speculation: on}}").routes["a"].speculation == "on"
    code = Policy.from_yaml("routes: {code: }").routes["code"]  # an empty entry: the default
    assert code == Policy.from_yaml("").default
    assert Policy.from_yaml("default: {max_kv_utilization: 1}").default.max_kv_utilization == 1.0


BAD_FILES = [
    "default: {num_draft_tokens: '6'}",
    "routes: {code: {num_draft_tokens: 6.5}}",
    "routes: {code: {unknown: 1}}",
    "default: {max_kv_utilization: .nan}",
    "routes: {code: [unclosed",  # not YAML
]


def test_reload_keeps_the_last_good_policy_and_logs_each_bad_file_once(tmp_path, caplog):
    path = tmp_path / "policy.yaml"
    path.write_text("routes: {code: {num_draft_tokens: 6}}")
    watched = PolicyFile(str(path))
    for i, bad in enumerate(BAD_FILES):
        path.write_text(bad + "\n" * (i + 1))  # a new size: a new version of the file
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="router.policy"):
            for _ in range(3):  # every request asks; the error is logged once
                assert watched.current().routes["code"].num_draft_tokens == 6
        assert len(caplog.records) == 1, bad
        assert "keeping the previous policy" in caplog.records[0].getMessage()
        assert str(path) in caplog.records[0].getMessage()
    path.write_text("routes: {code: {num_draft_tokens: 2}}")
    assert watched.current().routes["code"].num_draft_tokens == 2


def test_a_bad_policy_file_at_start_is_a_clear_error(tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_text("default: {num_draft_tokens: '6'}")
    with pytest.raises(PolicyError, match=r"policy\.yaml: default\.num_draft_tokens"):
        PolicyFile(str(path))
    proc = subprocess.run(
        [sys.executable, "-m", "launcher", "serve", "router", "--policy-file", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith("specd router: policy file ")
    assert "Traceback" not in proc.stderr
