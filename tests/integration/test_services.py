"""Drafter, verifier(s) and router in-process on loopback, with tiny models."""

import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from router.client import SpecdClient
from router.policy import Policy
from tests.cluster import start_cluster
from tests.conftest import wait_for

POLICY = Policy.from_dict(
    {
        "default": {"speculation": "auto", "num_draft_tokens": 3, "min_acceptance": 0.0},
        "routes": {
            "batch": {"speculation": "off"},
            "full": {"max_batch_size": 0},
            "kvfull": {"max_kv_utilization": 0.0},
            "picky": {"min_acceptance": 1.0},
        },
    }
)
PROMPTS = ["hello there, general", "def f(x): return x + 1", "abcabcabcabc"]


@pytest.fixture(scope="module")
def cluster(tiny_pair):
    # the drafter sends alternative leaves: every test here also crosses the wire with them
    c = start_cluster(*tiny_pair, policy=POLICY, replicas=2, alternatives=2)
    yield c
    c.close()


@pytest.fixture
def client(cluster):
    with SpecdClient(cluster.router) as c:
        yield c


def wait_idle(cluster, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        used = [e.kv.allocator.num_used for e in cluster.engines]
        if (
            not any(used)
            and cluster.proposer.kv.allocator.num_used == 0
            and cluster.drafter_servicer.num_sessions == 0
        ):
            return True
        time.sleep(0.02)
    return False


def test_unary_and_stream_agree(client):
    for prompt in PROMPTS:
        unary = client.generate(prompt, max_new_tokens=20, ignore_eos=True)
        chunks = list(client.stream(prompt, max_new_tokens=20, ignore_eos=True))
        assert "".join(c.text for c in chunks) == unary.text
        assert [t for c in chunks for t in c.token_ids] == list(unary.token_ids)
        assert chunks[-1].finish_reason == unary.finish_reason == "length"
        assert unary.usage.completion_tokens == 20


def test_greedy_identical_on_off_auto(cluster, client):
    for prompt in PROMPTS:
        out = {
            m: client.generate(prompt, max_new_tokens=24, ignore_eos=True, speculation=m)
            for m in ("on", "off", "auto")
        }
        assert out["on"].token_ids == out["off"].token_ids == out["auto"].token_ids
        assert out["on"].speculation.enabled and out["on"].speculation.drafted > 0
        assert not out["off"].speculation.enabled
        assert out["off"].speculation.reason == "off:client"
    assert sum(e.tree_rounds for e in cluster.engines) > 0  # alternatives crossed the wire


@pytest.mark.parametrize(
    "route,params,reason",
    [
        ("batch", {}, "off:policy"),
        ("full", {}, "off:batch"),
        ("kvfull", {}, "off:kv"),
        ("", {"temperature": 1.5, "seed": 1}, "off:temperature"),
    ],
)
def test_decision_reasons(client, route, params, reason):
    r = client.generate("hello", max_new_tokens=4, route=route, **params)
    assert r.speculation.reason == reason
    assert not r.speculation.enabled and r.speculation.drafted == 0
    assert r.route == (route or "default")


def test_auto_reports_what_the_verifier_did(client):
    for prompt in PROMPTS:
        r = client.generate(prompt, max_new_tokens=16, ignore_eos=True)
        spec = r.speculation
        assert spec.arrival_reason == "auto"
        assert spec.enabled == (spec.rounds > 0)
        # "on" exactly when rounds ran; otherwise the controller's own reason
        assert (spec.reason == "on") == (spec.rounds > 0) or spec.reason == "probe"
        assert spec.reason in ("on", "off:cost", "off:acceptance", "probe")
        if spec.rounds:
            assert spec.mean_draft_tokens == pytest.approx(spec.drafted / spec.rounds)
            assert 0 < spec.mean_draft_tokens <= spec.num_draft_tokens == 3


def test_the_account_of_a_request_a_stop_string_cut_is_what_it_drafted_until_then(client):
    """The router cancels a request at its stop string: its speculation account is the
    verifier's last, not an empty one; a request too short to draft says so."""
    whole = client.generate(PROMPTS[2], max_new_tokens=40, ignore_eos=True, speculation="on")
    assert whole.speculation.rounds > 4
    stop = whole.text[20:24]  # cut halfway
    cut = client.generate(
        PROMPTS[2], max_new_tokens=40, ignore_eos=True, speculation="on", stop=[stop]
    )
    assert cut.finish_reason == "stop" and len(cut.token_ids) < len(whole.token_ids)
    spec = cut.speculation
    assert spec.enabled and spec.reason == "on" and 0 < spec.rounds <= whole.speculation.rounds
    assert spec.rounds <= spec.drafted and spec.accepted <= spec.drafted
    assert spec.arrival_reason == "on"
    for mode, reason in (("on", "off:request"), ("auto", "off:request"), ("off", "off:client")):
        short = client.generate(PROMPTS[0], max_new_tokens=1, speculation=mode).speculation
        assert (short.reason, short.rounds, short.enabled) == (reason, 0, False)


def test_acceptance_branch_and_route_metadata(client):
    # speculate on the route first, so the verifier has an acceptance rate for it (< 1.0)
    first = client.generate(
        "abcdefgh",
        max_new_tokens=30,
        ignore_eos=True,
        speculation="on",
        metadata=[("x-route", "picky")],
    )
    assert first.route == "picky" and first.speculation.drafted > 0
    assert first.speculation.accepted < first.speculation.drafted
    r = client.generate("abcdefgh", max_new_tokens=4, metadata=[("x-route", "picky")])
    assert r.speculation.reason == "off:acceptance" and r.speculation.drafted == 0
    assert r.speculation.arrival_reason == "auto"  # the verifier decided, step by step


def test_unknown_route_falls_back_with_warning(client):
    r = client.generate("hi", max_new_tokens=2, route="nope")
    assert r.route == "default" and "unknown route" in r.warnings[0]


def test_chat_messages_and_stop_strings(client):
    full = client.generate(
        messages=[{"role": "user", "content": "hi"}], max_new_tokens=30, ignore_eos=True
    )
    assert full.finish_reason == "length"
    stop = full.text[10:12]
    cut = client.generate(
        messages=[{"role": "user", "content": "hi"}],
        max_new_tokens=30,
        ignore_eos=True,
        stop=[stop],
        speculation="on",
    )
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]


def test_two_replicas_share_load(cluster, client):
    before = [s.requests_started for s in cluster.verifier_servicers]

    def one(i):
        with SpecdClient(cluster.router) as c:
            c.generate(PROMPTS[i % 3], max_new_tokens=16, ignore_eos=True, speculation="off")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    served = [
        s.requests_started - b for s, b in zip(cluster.verifier_servicers, before, strict=True)
    ]
    assert sum(served) == 8
    assert all(n > 0 for n in served), f"one replica got nothing: {served}"


def test_client_cancel_frees_kv_in_both_caches(cluster, client):
    assert wait_idle(cluster)
    stream = client.stream("abcabcabc", max_new_tokens=400, ignore_eos=True, speculation="on")
    got = 0
    for msg in stream:
        got += len(msg.token_ids)
        if got >= 5:
            break
    assert any(e.kv.allocator.num_used for e in cluster.engines)
    stream.cancel()
    assert wait_idle(cluster), "KV blocks or drafter sessions were not released"


def test_deadline_exceeded(client, cluster, aborts):
    # drafting forced on, 500 tokens: far longer than the deadline on any host; the
    # verifier is told to abort the request, and frees both caches
    assert wait_idle(cluster)
    with pytest.raises(grpc.RpcError) as err:
        client.generate("abc", max_new_tokens=500, ignore_eos=True, speculation="on", timeout=0.3)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_idle(cluster, timeout=2.0)  # both caches freed, not left to expire
    assert len(aborts) == 1  # cut short, not run to its end


def test_bad_input_gets_invalid_argument(client):
    cases = [
        dict(),
        dict(prompt="x", temperature=-1.0),
        dict(prompt="x", top_k=-2),
        dict(prompt="x", max_new_tokens=100_000),
        dict(token_ids=[5, 500]),
        dict(token_ids=[5, -1]),
        dict(prompt=""),
        dict(prompt="x", top_p=1.5),
        dict(prompt="x", top_p=-0.5),
        dict(prompt="x", max_new_tokens=-2),  # -1 is "what the context leaves"
        dict(prompt="x" * 500, max_new_tokens=100),  # over the tiny models' 512 context
    ]
    for kwargs in cases:
        with pytest.raises(grpc.RpcError) as err:
            client.generate(**kwargs)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, kwargs
        assert err.value.details()


def test_a_request_over_the_context_names_openais_code(client):
    with pytest.raises(grpc.RpcError) as err:
        client.generate("x" * 500, max_new_tokens=100)  # the tiny models' context: 512
    assert "maximum context length is 512 tokens" in err.value.details()
    assert ("error-code", "context_length_exceeded") in err.value.trailing_metadata()


def test_a_message_over_the_grpc_size_limit_is_refused(client):
    with pytest.raises(grpc.RpcError) as err:
        client.generate("x" * (17 << 20), max_new_tokens=1)  # the limit is 16 MiB
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in err.value.details()


def test_health_and_reflection(cluster):
    for address in [cluster.router, cluster.drafter, *cluster.verifiers]:
        with grpc.insecure_channel(address) as ch:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
            assert status.status == health_pb2.HealthCheckResponse.SERVING
            stub = reflection_pb2_grpc.ServerReflectionStub(ch)
            resp = next(
                stub.ServerReflectionInfo(
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")])
                )
            )
            names = {s.name for s in resp.list_services_response.service}
            assert "grpc.health.v1.Health" in names and any("specd.v1" in n for n in names)


def router_sees_drafter(cluster, available: bool) -> bool:
    """Whether the router's latest load report from every replica says so."""
    reports = [r.report for r in cluster.replicas.replicas.values()]
    return all(r is not None and r.drafter_available == available for r in reports)


def test_drafter_killed_mid_stream_every_request_completes(cluster):
    tokens = 200  # long enough to be running, on any host, when the drafter dies
    expected = {}
    with SpecdClient(cluster.router) as c:
        for p in PROMPTS:
            expected[p] = list(
                c.generate(p, max_new_tokens=tokens, ignore_eos=True, speculation="off").token_ids
            )
    results, errors = {}, []

    def one(p):
        try:
            with SpecdClient(cluster.router) as c:
                results[p] = list(
                    c.generate(
                        p, max_new_tokens=tokens, ignore_eos=True, speculation="on"
                    ).token_ids
                )
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    # every request running on a verifier, and drafts being served
    running = lambda: sum(e.scheduler.batch for e in cluster.engines)  # noqa: E731
    wait_for(lambda: running() == len(PROMPTS) and cluster.drafter_servicer.num_sessions > 0)
    cluster.stop_drafter()
    assert not results, "every request must still be running when the drafter dies"
    for t in threads:
        t.join(60)
    assert not errors and results == expected
    # with the drafter gone, auto turns speculation off and says why
    wait_for(lambda: router_sees_drafter(cluster, False), timeout=10)
    with SpecdClient(cluster.router) as c:
        r = c.generate("abc", max_new_tokens=3)
        assert r.speculation.reason == "off:drafter-unavailable"
    cluster.start_drafter()
    # every replica reconnects by itself, and the router sees it in a load report
    wait_for(lambda: router_sees_drafter(cluster, True), timeout=10)
    with SpecdClient(cluster.router) as c:
        for _ in cluster.verifiers:  # auto is allowed again on every replica
            assert c.generate("abc", max_new_tokens=3).speculation.arrival_reason == "auto"
    with SpecdClient(cluster.router) as c:
        r = c.generate("abcabc", max_new_tokens=8, ignore_eos=True, speculation="on")
        assert r.speculation.reason == "on" and r.speculation.drafted > 0


def test_a_full_replica_sends_requests_to_the_other(cluster):
    full, other = cluster.verifier_servicers
    queue = full.max_queue
    try:
        full.max_queue = 0  # its queue is always full
        before = other.requests_started
        with SpecdClient(cluster.router) as c:
            for _ in range(4):
                assert (
                    c.generate(
                        "abc", max_new_tokens=3, ignore_eos=True, speculation="off"
                    ).usage.completion_tokens
                    == 3
                )
        assert other.requests_started > before
        other.max_queue = 0  # now both refuse: the client hears why, with a retry hint
        with SpecdClient(cluster.router) as c:
            with pytest.raises(grpc.RpcError) as err:
                c.generate("abc", max_new_tokens=3)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "retry" in err.value.details()
        assert ("retry-after-ms", "500") in tuple(err.value.trailing_metadata() or ())
    finally:
        full.max_queue = other.max_queue = queue


def test_draft_ahead_through_the_services_keeps_parity(tiny_pair):
    c = start_cluster(*tiny_pair, policy=POLICY, draft_ahead=True)
    runs = []
    real = c.proposer.draft_ahead

    def counted(stop):
        runs.append(1)
        return real(stop)

    c.proposer.draft_ahead = counted
    try:
        with SpecdClient(c.router) as client:
            for prompt in PROMPTS:
                on, off = (
                    client.generate(prompt, max_new_tokens=24, ignore_eos=True, speculation=m)
                    for m in ("on", "off")
                )
                assert on.token_ids == off.token_ids and on.speculation.drafted > 0
        assert runs  # the drafter worked ahead between rounds (hits: test_engine.py)
        assert wait_idle(c)
    finally:
        c.close()
