"""The verifier's `Draft` stream when the drafter is gone: a round fails at once rather than
waiting out its deadline (a dead drafter once stalled every round of the batch for the
3 s round timeout, in a clean-clone run of test_faults)."""

from __future__ import annotations

import time

import pytest

from launcher.processes import free_port
from protos.specd.v1 import drafter_pb2
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
