"""Faults injected into real server processes on loopback: SIGKILL a drafter, a verifier
replica, the router, and check that nothing is lost and nothing hangs.

The processes serve a tiny random Qwen2 (fp32, batch-invariant kernels, so a greedy output
cannot depend on which requests happened to share a step) with a character tokenizer.
"""

from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait

import grpc
import pytest

from launcher.processes import ROUTER_READY, ServerProcess, free_port, scrape, start_together
from router.client import SpecdClient
from specd.channels import check_health
from specd.telemetry import RUNNING, TOKENS_OUT
from tests.cluster import save_tiny_cluster_model
from tests.conftest import wait_for

pytestmark = pytest.mark.timeout(300)

PROMPTS = [f"request {i}: {'abcdefgh'[i % 8] * (1 + i % 5)}" for i in range(200)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return save_tiny_cluster_model(tmp_path_factory.mktemp("tiny-served"))


def model_flags(model) -> list[str]:
    return ["--model", str(model), "--dtype", "float32"]


def verifier(
    model, logs, *flags, drafter: str = "", metrics_port: int = 0, env=None
) -> ServerProcess:
    extra = ["--drafter", drafter, "--drafter-reconnect-ms", "200"] if drafter else []
    if metrics_port:
        extra += ["--metrics-port", str(metrics_port)]
    return ServerProcess(
        "verifier", *model_flags(model), "--batch-invariant", *extra, *flags, logs=logs, env=env
    )


def router(model, logs, *verifiers: ServerProcess, extra: tuple = ()) -> ServerProcess:
    flags = [x for v in verifiers for x in ("--verifier", v.address)]
    return ServerProcess(
        "router", "--tokenizer", str(model), *flags, *extra, logs=logs, ready_service=ROUTER_READY
    )


def greedy(client: SpecdClient, prompt: str, max_new_tokens: int = 16, **kw):
    r = client.generate(prompt, max_new_tokens=max_new_tokens, ignore_eos=True, timeout=60, **kw)
    return list(r.token_ids)


def test_drafter_sigkilled_and_restarted_loses_nothing(model, tmp_path):
    fallbacks_port = free_port()
    drafter = ServerProcess("drafter", *model_flags(model), logs=tmp_path)
    target = verifier(model, tmp_path, drafter=drafter.address, metrics_port=fallbacks_port)
    front = router(model, tmp_path, target)
    start_together(drafter, target, front)
    try:
        with SpecdClient(front.address) as client, ThreadPoolExecutor(8) as pool:
            # long enough that the drafter's restart (a few seconds) lands mid-run: at 64
            # tokens a request, the load once finished before the restart did (a clean-clone
            # run, after the layers went native and the tiny model's steps got faster)
            run = lambda p: greedy(client, p, 128, speculation="on")  # noqa: E731
            clean = list(pool.map(run, PROMPTS))
            assert scrape(fallbacks_port, "specd:drafter_fallbacks") == 0

            futures = [pool.submit(run, p) for p in PROMPTS]
            while sum(f.done() for f in futures) < 20:
                time.sleep(0.01)
            drafter.kill()
            killed_at = sum(f.done() for f in futures)
            time.sleep(1.0)  # requests keep running without drafts meanwhile
            drafter.start()
            restarted_at = sum(f.done() for f in futures)
            wait(futures, timeout=120)
            faulty = [f.result() for f in futures]  # raises if any request failed
        assert killed_at < restarted_at < len(PROMPTS), "the fault must hit a running load"
        assert faulty == clean
        assert scrape(fallbacks_port, "specd:drafter_fallbacks") > 0  # the fault was felt
    finally:
        for p in (front, target, drafter):
            p.stop()


def test_a_killed_replica_is_retried_around_then_avoided_until_healthy(model, tmp_path):
    # one running sequence per replica, so most requests wait in a queue without a token
    a = verifier(model, tmp_path, "--max-batch-size", "1")
    b = verifier(model, tmp_path, "--max-batch-size", "1")
    start_together(a, b)
    front = router(model, tmp_path, a, b).start()  # both healthy: its first connections hold
    first_token: dict[int, float] = {}
    outcomes: dict[int, object] = {}

    def one(i: int) -> None:
        try:
            with SpecdClient(front.address) as client:
                n = 0
                for msg in client.stream(
                    PROMPTS[i], max_new_tokens=120, ignore_eos=True, timeout=60
                ):
                    first_token.setdefault(i, time.monotonic())
                    n += len(msg.token_ids)
                outcomes[i] = n
        except grpc.RpcError as exc:
            outcomes[i] = exc.code()

    try:
        threads = [threading.Thread(target=one, args=(i,)) for i in range(10)]
        for t in threads:
            t.start()
        while len(first_token) < 2:
            time.sleep(0.01)
        a.kill()
        killed = time.monotonic()
        for t in threads:
            t.join(90)
        assert not any(t.is_alive() for t in threads), "a request hung"
        for i in range(10):
            streamed_before_kill = first_token.get(i, float("inf")) < killed
            if streamed_before_kill:  # cannot be replayed: a clear status or a full answer
                assert outcomes[i] in (120, grpc.StatusCode.UNAVAILABLE), outcomes[i]
            else:  # had not streamed: retried on the other replica, complete
                assert outcomes[i] == 120, (i, outcomes[i])
        assert sum(o == 120 for o in outcomes.values()) >= 8

        # later requests go to the healthy replica only (the router saw its load stream
        # end): no failed attempt, so no retry shows up in the router's log
        ended = f"replica {a.address}: load stream ended"
        wait_for(lambda: ended in front.log(tail=1 << 20), timeout=10)
        retries_before = front.log().count("trying another")
        with SpecdClient(front.address) as client:
            for p in PROMPTS[:6]:
                assert len(greedy(client, p)) == 16
        assert front.log().count("trying another") == retries_before

        # with b gone too the router is not ready; a, restarted on its port, is taken back
        b.kill()
        wait_for(lambda: not check_health(front.address, service=ROUTER_READY))
        a.start()
        wait_for(lambda: check_health(front.address, service=ROUTER_READY))
        with SpecdClient(front.address) as client:
            for p in PROMPTS[:4]:
                assert len(greedy(client, p)) == 16
    finally:
        for p in (front, a, b):
            p.stop()


def test_router_restart_means_unavailable_never_a_hang(model, tmp_path):
    target = verifier(model, tmp_path)
    front = router(model, tmp_path, target)
    start_together(target, front)
    try:
        with SpecdClient(front.address) as client:
            stream = client.stream(PROMPTS[0], max_new_tokens=400, ignore_eos=True)
            next(stream)
            front.kill()
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                for _ in stream:
                    pass
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            # while it is down, a call without any deadline fails fast, it does not wait
            with pytest.raises(grpc.RpcError) as err:
                client.generate(PROMPTS[1], max_new_tokens=4)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert time.monotonic() - started < 10
            # and the same client works again once the router is back on its port
            front.start()
            deadline = time.monotonic() + 30
            while True:
                try:
                    assert len(greedy(client, PROMPTS[2])) == 16
                    break
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.UNAVAILABLE
                    assert time.monotonic() < deadline, "the client never reconnected"
                    time.sleep(0.5)
    finally:
        for p in (front, target):
            p.stop()


def test_sigterm_drains_a_verifier_its_running_requests_finish(model, tmp_path):
    # two replicas busy at once: one core each, as a deployment gives each its own (two
    # OpenMP teams of two on 2 cores wait on each other's descheduled threads at every op:
    # the tiny model's 200 tokens took 5-30 s instead of 0.3). 400 tokens (of the tiny
    # model's 512 positions) keep a running ~1.3 s after SIGTERM; NOT_SERVING shows in ~10 ms.
    # Whether `a` is still up once NOT_SERVING shows depends on that margin (a loaded host
    # took longer to see it): the drain shows in the four streams instead. Each had sent a
    # message, so none can be retried elsewhere (router/generation.py): all four end whole
    # only if `a` served its running ones to the end
    a_metrics, b_metrics = free_port(), free_port()
    one_core, tokens = {"OMP_NUM_THREADS": "1"}, 400
    a = verifier(model, tmp_path, "--drain-seconds", "120", metrics_port=a_metrics, env=one_core)
    b = verifier(model, tmp_path, metrics_port=b_metrics, env=one_core)
    start_together(a, b)
    front = router(model, tmp_path, a, b).start()
    try:
        with SpecdClient(front.address) as client:
            streams = [
                client.stream(p, max_new_tokens=tokens, ignore_eos=True) for p in PROMPTS[:4]
            ]
            counts = [len(next(s).token_ids) for s in streams]  # all four are running
            assert scrape(a_metrics, RUNNING) > 0, "the drain must hit requests running on a"
            a.proc.send_signal(signal.SIGTERM)
            # NOT_SERVING at once: probes and peers stop sending
            wait_for(lambda: a.proc.poll() is not None or not check_health(a.address), timeout=10)
            assert all(n < tokens for n in counts)
            with ThreadPoolExecutor(4) as pool:  # read all four as their clients would
                rest = pool.map(lambda s: sum(len(m.token_ids) for m in s), streams)
                counts = [n + m for n, m in zip(counts, rest, strict=True)]
            assert counts == [tokens] * 4  # none was cut, on either replica
            assert a.proc.wait(30) == 0
            # new requests go to the other replica, none fails
            served = scrape(b_metrics, TOKENS_OUT)
            for p in PROMPTS[4:8]:
                assert len(greedy(client, p)) == 16
            assert scrape(b_metrics, TOKENS_OUT) == served + 4 * 16
    finally:
        for p in (front, a, b):
            p.stop()
