"""One open `Draft` call to a drafter, synchronous: requests go through a queue and a reader
thread pairs each response with the round waiting for it, and hands drafts the drafter
pushed ahead to `on_ahead` (verifier_service/drafter_client.py turns rounds into proposals
on top of it)."""

from __future__ import annotations

import queue
import threading

import grpc

from protos.specd.v1 import drafter_pb2, drafter_pb2_grpc
from specd.channels import open_channel


class DraftStream:
    """One open `Draft` call: requests go through a queue, a reader thread pairs responses
    with waiting rounds."""

    def __init__(self, address: str, tls_ca: str = "", on_ahead=None):
        self.channel = open_channel(address, tls_ca)
        # called on the reader thread with each response pushed ahead (the handshake asks
        # for them when it is set)
        self.on_ahead = on_ahead
        self._requests: queue.Queue = queue.Queue()
        self._waiters: dict[int, list] = {}
        self._lock = threading.Lock()
        self.alive = True
        self.ready = False  # set when the drafter answered the handshake (an empty round 0)
        self.drafter = ""  # what the handshake said drafts
        self.lookup_only = False  # the handshake said no round costs the drafter a forward
        self.context_window = 0  # the handshake's: what a new sequence's prefill costs it
        self.combined_lookup = False  # the handshake's: its proposer looks up first
        self.ended = ""  # why the call ended (a gRPC status; the caller says it)
        self._requests.put(drafter_pb2.DraftRequest(round=0, push_ahead=on_ahead is not None))
        requests = iter(self._requests.get, None)
        responses = drafter_pb2_grpc.DrafterStub(self.channel).Draft(requests)
        self._reader = threading.Thread(target=self._read, args=(responses,), daemon=True)
        self._reader.start()

    def _read(self, responses) -> None:
        try:
            for resp in responses:
                if resp.ahead:
                    if self.on_ahead is not None:
                        self.on_ahead(resp)
                    continue
                if resp.round == 0:
                    self.drafter, self.lookup_only = resp.drafter, resp.lookup_only
                    self.context_window = resp.context_window
                    self.combined_lookup = resp.combined_lookup
                self.ready = True
                with self._lock:
                    waiter = self._waiters.pop(resp.round, None)
                if waiter is not None:
                    waiter[1] = resp
                    waiter[0].set()
            self.ended = "closed by the drafter"
        except grpc.RpcError as exc:
            self.ended = exc.code().name
        finally:
            with self._lock:
                self.alive = False
                waiters, self._waiters = list(self._waiters.values()), {}
            for event, _ in waiters:
                event.set()

    def call(self, request, timeout_s: float):
        return self.wait(request.round, self.start(request), timeout_s)

    def start(self, request) -> list:
        """Send a round without waiting for it: -> its waiter, for `wait` (a waiter never
        waited for is dropped when its response comes)."""
        waiter = [threading.Event(), None]
        with self._lock:
            # checked under the lock the reader ends under: a waiter added after the reader
            # woke the last ones would wait out the whole timeout (a dead drafter then
            # stalled every round of the batch for `timeout_s`)
            if not self.alive:
                raise ConnectionError("drafter stream closed")
            self._waiters[request.round] = waiter
        self._requests.put(request)
        return waiter

    def wait(self, round_: int, waiter: list, timeout_s: float):
        """The response to a round `start` sent."""
        if not waiter[0].wait(timeout_s):
            with self._lock:
                self._waiters.pop(round_, None)
            raise TimeoutError(f"drafter round {round_} took over {timeout_s:.3f}s")
        if waiter[1] is None:
            raise ConnectionError("drafter stream closed")
        return waiter[1]

    def send(self, request) -> None:
        self._requests.put(request)

    def close(self) -> None:
        self._requests.put(None)
        self.channel.close()
