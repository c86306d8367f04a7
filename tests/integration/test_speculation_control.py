"""The verifier's speculation controller across the services (issue 15): a route that a
burst of rejected drafts switched off comes back by itself, KV pressure switches drafting
off and on again, and the response says what the verifier did.

The tiny target's forward costs ~3 ms, less than a drafter round over gRPC, so on its own
speculation would never pay (and the controller rightly never drafts). The verifier's
model here sleeps 20 ms per forward whatever its rows, as a memory-bound target does; the
drafter is a copy of the target, so its drafts are accepted unless a test spoils them.
"""

import copy
import time

import pytest

from router.client import SpecdClient
from router.policy import Policy
from specd.config import EngineConfig
from specd.proposal import Proposal
from tests.cluster import start_cluster

POLICY = Policy.from_dict(
    {
        "default": {"num_draft_tokens": 4, "min_acceptance": 0.5, "max_kv_utilization": 0.5},
        "routes": {"chat": {}},
    }
)


@pytest.fixture(scope="module")
def cluster(tiny_pair):
    target, _ = tiny_pair
    slow = copy.deepcopy(target)
    forward = slow.forward

    def memory_bound(kv, seqs):
        time.sleep(0.02)
        return forward(kv, seqs)

    slow.forward = memory_bound
    c = start_cluster(
        slow, copy.deepcopy(target), policy=POLICY, engine_config=EngineConfig(num_blocks=64)
    )
    yield c
    c.close()


def spoil(proposer):
    """Make every draft wrong (the next id of the right one): 0% acceptance."""
    real = proposer.propose
    vocab = proposer.model.args.vocab_size

    def wrong(states):
        return [Proposal([(t + 1) % vocab for t in p.tokens]) for p in real(states)]

    proposer.propose = wrong
    return lambda: setattr(proposer, "propose", real)


def test_a_route_switched_off_by_a_bad_burst_comes_back_by_itself(cluster):
    prompt = "the quick brown fox"
    with SpecdClient(cluster.router) as c:
        first = c.generate(prompt, max_new_tokens=40, ignore_eos=True, route="chat")
        assert first.speculation.reason == "on" and first.speculation.accepted > 0
        restore = spoil(cluster.proposer)
        try:  # a burst of forced rounds that all fail pulls the route's acceptance to ~0
            for _ in range(6):
                r = c.generate(
                    prompt, max_new_tokens=40, ignore_eos=True, route="chat", speculation="on"
                )
                assert r.speculation.drafted > 0 and r.speculation.accepted == 0
            r = c.generate(prompt, max_new_tokens=40, ignore_eos=True, route="chat")
            assert r.speculation.reason in ("off:acceptance", "probe")
        finally:
            restore()
        reasons = []
        for _ in range(10):  # normal traffic, nobody forcing anything
            r = c.generate(prompt, max_new_tokens=40, ignore_eos=True, route="chat")
            reasons.append(r.speculation.reason)
            if r.speculation.reason == "on":
                break
        assert reasons[-1] == "on", reasons
        assert r.speculation.accepted > 0


def wait_for_report(cluster, used_blocks) -> None:
    """Until the router's view of the replica shows `used_blocks(n)` true."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        reports = [r.report for r in cluster.replicas.replicas.values()]
        if all(r is not None and used_blocks(r.kv_blocks_used) for r in reports):
            return
        time.sleep(0.02)
    raise AssertionError("no load report with the expected KV use")


def test_kv_pressure_turns_drafting_off_and_it_comes_back(cluster):
    engine = cluster.engines[0]
    with SpecdClient(cluster.router) as c:
        # hold most of the pool: the route allows drafting only below 50% use
        held = engine.kv.allocator
        pressure = int(held.num_blocks * 0.7)
        wait_for_report(cluster, lambda n: n == 0)  # nothing left of earlier requests
        held.allocate("pressure", reserve_tokens=pressure * held.block_size)
        try:
            wait_for_report(cluster, lambda n: n >= pressure)
            r = c.generate("hello world", max_new_tokens=24, ignore_eos=True)
            assert r.speculation.reason == "off:kv" and r.speculation.drafted == 0
            assert r.speculation.arrival_reason == "off:kv"
        finally:
            held.free("pressure")
        wait_for_report(cluster, lambda n: n == 0)
        r = c.generate("hello world", max_new_tokens=24, ignore_eos=True)
        assert r.speculation.reason == "on" and r.speculation.drafted > 0
