"""The verifier's `Draft` stream when the drafter is gone: a round fails at once rather than
waiting out its deadline (a dead drafter once stalled every round of the batch for the
3 s round timeout, in a clean-clone run of test_faults), and what the verifier logs while
its drafter is not there."""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from launcher.processes import free_port
from protos.specd.v1 import drafter_pb2, drafter_pb2_grpc
from verifier_service.drafter_client import RemoteProposer
from verifier_service.drafter_stream import DraftStream


def test_a_round_on_a_stream_that_already_ended_fails_at_once():
    stream = DraftStream(f"127.0.0.1:{free_port()}")  # nothing listens there
    try:
        deadline = time.monotonic() + 10
        while stream.alive:  # the reader sees UNAVAILABLE and ends
            assert time.monotonic() < deadline, "the stream to nowhere never ended"
            time.sleep(0.01)
        started = time.monotonic()
        with pytest.raises(ConnectionError):
            stream.call(drafter_pb2.DraftRequest(round=1), timeout_s=30)
        # before the fix this waited out all 30 s and raised TimeoutError
        assert time.monotonic() - started < 5
    finally:
        stream.close()


class _Echo(drafter_pb2_grpc.DrafterServicer):
    """A drafter that answers every round, the handshake included, with no drafts."""

    def Draft(self, request_iterator, context):
        for request in request_iterator:
            yield drafter_pb2.DraftResponse(round=request.round, drafter="echo")


def test_a_drafter_not_reachable_is_said_once_and_one_lost_each_time(caplog):
    """A verifier started before its drafter (as `specd up` starts them) retries quietly:
    one line that it is not reachable, one when it connects; a drafter lost after that is
    a warning."""
    address = f"127.0.0.1:{free_port()}"
    remote = RemoteProposer(address, reconnect_ms=20)

    def said(until) -> list[tuple[int, str]]:
        deadline = time.monotonic() + 10
        while not until():  # `available` connects when it is time to try again
            assert time.monotonic() < deadline
            time.sleep(0.01)
        for _ in range(20):  # retries every 20 ms meanwhile: none of them says anything more
            remote.available  # noqa: B018
            time.sleep(0.01)
        out = [(r.levelno, r.getMessage()) for r in caplog.records]
        caplog.clear()
        return out

    server = None
    caplog.set_level(logging.INFO, logger="verifier_service.drafter_client")
    try:
        [(level, text)] = said(lambda: not remote.available and caplog.records)
        assert level == logging.INFO and "not reachable (UNAVAILABLE)" in text
        for _ in range(2):
            server = grpc.server(ThreadPoolExecutor(2))
            drafter_pb2_grpc.add_DrafterServicer_to_server(_Echo(), server)
            server.add_insecure_port(address)
            server.start()
            assert said(lambda: remote.available) == [
                (logging.INFO, f"drafter {address} connected: echo")
            ]
            server.stop(0).wait()
            [(level, text)] = said(lambda: not remote.available)
            assert level == logging.WARNING and text.startswith(f"drafter {address} lost (")
    finally:
        remote.shutdown()
        if server is not None:
            server.stop(0)
