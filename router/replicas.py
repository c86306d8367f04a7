"""Verifier replicas: watch each one's `WatchLoad`, send a request to the least loaded."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

import grpc

from protos.specd.v1 import verifier_pb2, verifier_pb2_grpc
from specd.serving import MAX_MESSAGE_BYTES, open_channel

log = logging.getLogger(__name__)
STALE_S = 1.0  # a replica whose last report is older than this is not chosen


@dataclass
class Replica:
    address: str
    channel: grpc.aio.Channel
    stub: verifier_pb2_grpc.VerifierStub
    report: verifier_pb2.LoadReport | None = None
    seen: float = 0.0
    inflight: int = 0  # requests this router sent and that have not finished
    chosen: float = 0.0  # when this router last sent it a request (ties go to the oldest)
    finished: float = 0.0  # when a request of this router's last finished there
    task: asyncio.Task | None = field(default=None, repr=False)

    @property
    def healthy(self) -> bool:
        return self.report is not None and time.monotonic() - self.seen < STALE_S

    def score(self) -> tuple:
        r = self.report
        # a report older than our last completion there may still count that request
        fresh = r is not None and self.seen >= self.finished
        util = r.kv_blocks_used / r.kv_blocks_total if fresh and r.kv_blocks_total else 0.0
        queued = (r.running + r.waiting) if fresh else 0
        return (max(queued, self.inflight), util, self.chosen)


class ReplicaSet:
    def __init__(self, addresses: list[str], tls_ca: str = ""):
        self.tls_ca = tls_ca
        self.replicas: dict[str, Replica] = {}
        self._addresses = list(addresses)

    async def start(self) -> None:
        for address in self._addresses:
            self.add(address)

    def add(self, address: str) -> None:
        if address in self.replicas:
            return
        options = [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            # a restarted replica is taken back within ~2 s, not after minutes of back-off
            ("grpc.initial_reconnect_backoff_ms", 200),
            ("grpc.max_reconnect_backoff_ms", 2000),
        ]
        channel = open_channel(address, self.tls_ca, aio=True, options=options)
        replica = Replica(address, channel, verifier_pb2_grpc.VerifierStub(channel))
        replica.task = asyncio.get_running_loop().create_task(self._watch(replica))
        self.replicas[address] = replica

    async def remove(self, address: str) -> None:
        replica = self.replicas.pop(address, None)
        if replica is not None:
            replica.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await replica.task
            await replica.channel.close()

    async def sync(self, addresses: list[str]) -> None:
        """Watch exactly these addresses: add new replicas, drop vanished ones."""
        wanted = set(addresses)
        for address in wanted - set(self.replicas):
            self.add(address)
        for address in set(self.replicas) - wanted:
            await self.remove(address)

    async def close(self) -> None:
        for address in list(self.replicas):
            await self.remove(address)

    async def _watch(self, replica: Replica) -> None:
        while True:
            try:
                async for report in replica.stub.WatchLoad(verifier_pb2.WatchLoadRequest()):
                    replica.report, replica.seen = report, time.monotonic()
            except grpc.aio.AioRpcError as exc:
                log.debug("load watch of %s ended: %s", replica.address, exc.code())
            replica.report = None
            await asyncio.sleep(0.2)

    def any_healthy(self) -> bool:
        return any(r.healthy for r in self.replicas.values())

    def choose(self, exclude: set[str] = frozenset()) -> Replica | None:
        """Least-loaded healthy replica not in `exclude` (None if there is none)."""
        healthy = [r for a, r in self.replicas.items() if r.healthy and a not in exclude]
        best = min(healthy, key=Replica.score, default=None)
        if best is not None:
            best.chosen = time.monotonic()
        return best

    async def wait_ready(self, timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(r.healthy for r in self.replicas.values()):
                return True
            await asyncio.sleep(0.05)
        return False
