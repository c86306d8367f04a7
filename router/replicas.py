"""Verifier replicas: watch each one's `WatchLoad`, send a request to the least loaded,
or to a replica that likely holds its prompt's prefix (router/affinity.py).

Every replica's watcher runs in one anyio task group, hosted by `ReplicaSet.run` (the
router's serve runs it in its own task group; `start`/`close` host it for callers that
have none); removing a replica cancels its watcher's scope."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field

import anyio
import grpc

from protos.specd.v1 import verifier_pb2, verifier_pb2_grpc
from router.affinity import BALANCE, PrefixAffinity
from specd.channels import MAX_MESSAGE_BYTES, open_channel
from specd.params import SamplingParams

log = logging.getLogger(__name__)
STALE_S = 1.0  # a replica whose last report is older than this is not chosen


_TASKS = itertools.count()


@dataclass
class Serving:
    """A request this router has in flight on a replica (router/relay.py's attempt), as
    llama-server's /slots shows a slot's task (router/slots_http.py)."""

    prompt_tokens: int
    max_new_tokens: int
    params: SamplingParams
    decoded: int = 0  # tokens the replica has streamed back
    cached: int = 0  # of the prompt's, those found in the replica's prefix cache
    new_line: bool = False  # whether the text streamed back holds a line break
    task: int = field(default_factory=lambda: next(_TASKS))


@dataclass
class Replica:
    address: str
    channel: grpc.aio.Channel
    stub: verifier_pb2_grpc.VerifierStub
    report: verifier_pb2.LoadReport | None = None
    seen: float = 0.0
    serving: dict[int, Serving] = field(default_factory=dict)  # by task, until they finish
    chosen: float = 0.0  # when this router last sent it a request (ties go to the oldest)
    finished: float = 0.0  # when a request of this router's last finished there
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope, repr=False)

    @property
    def inflight(self) -> int:
        """Requests this router sent and that have not finished."""
        return len(self.serving)

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
    def __init__(self, addresses: list[str], tls_ca: str = "", prefix_affinity: bool = True):
        """`prefix_affinity`: send a prompt where its prefix likely is cached (else the
        least loaded replica always)."""
        self.tls_ca = tls_ca
        self.affinity = PrefixAffinity() if prefix_affinity else None
        self.on_choice = None  # called with how affinity chose: cached, busy or new
        self.replicas: dict[str, Replica] = {}
        self._addresses = list(addresses)
        self._group: anyio.abc.TaskGroup | None = None
        self._host: asyncio.Task | None = None

    async def run(self, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        """Watch the replicas until cancelled; `started` once the first ones are added."""
        try:
            async with anyio.create_task_group() as group:
                self._group = group
                for address in self._addresses:
                    self.add(address)
                task_status.started()
                await anyio.sleep_forever()
        finally:
            self._group = None
            with anyio.CancelScope(shield=True):
                for replica in self.replicas.values():
                    await replica.channel.close()
                self.replicas.clear()

    async def start(self) -> None:
        """run() in a task of its own, until close()."""
        started = asyncio.get_running_loop().create_future()

        async def host():
            async with anyio.create_task_group() as group:
                await group.start(self.run)
                started.set_result(None)

        self._host = asyncio.get_running_loop().create_task(host())
        await started

    async def close(self) -> None:
        if self._host is not None:
            self._host.cancel()
            await asyncio.gather(self._host, return_exceptions=True)
            self._host = None

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
        self.replicas[address] = replica
        self._group.start_soon(self._watch, replica)

    async def remove(self, address: str) -> None:
        replica = self.replicas.pop(address, None)
        if self.affinity is not None:
            self.affinity.forget(address)
        if replica is not None:
            replica.scope.cancel()
            await replica.channel.close()

    async def sync(self, addresses: list[str]) -> None:
        """Watch exactly these addresses: add new replicas, drop vanished ones."""
        wanted = set(addresses)
        for address in wanted - set(self.replicas):
            self.add(address)
        for address in set(self.replicas) - wanted:
            await self.remove(address)

    async def _watch(self, replica: Replica) -> None:
        with replica.scope:
            while True:
                try:
                    async for report in replica.stub.WatchLoad(verifier_pb2.WatchLoadRequest()):
                        replica.report, replica.seen = report, time.monotonic()
                except grpc.aio.AioRpcError as exc:
                    if replica.report is not None:  # it was serving: said once, not per retry
                        if self.affinity is not None:  # restarted, its cache starts empty
                            self.affinity.forget(replica.address)
                        log.info(
                            "replica %s: load stream ended (%s); not chosen until it reports",
                            replica.address,
                            exc.code().name,
                        )
                replica.report = None
                await anyio.sleep(0.2)

    def reporting(self) -> list[Replica]:
        """The replicas that have sent a load report since their watch last (re)started."""
        return [r for r in self.replicas.values() if r.report is not None]

    def any_healthy(self) -> bool:
        return any(r.healthy for r in self.replicas.values())

    def choose(self, exclude: set[str] = frozenset(), keys: list[bytes] = ()) -> Replica | None:
        """A healthy replica not in `exclude` (None if there is none): of those likely
        holding the longest prefix of the prompt whose chunk keys are `keys`
        (router.affinity.chunk_keys), the least loaded, where it has at most BALANCE
        requests more than the least loaded of all; else the least loaded."""
        healthy = {a: r for a, r in self.replicas.items() if r.healthy and a not in exclude}
        best = min(healthy.values(), key=Replica.score, default=None)
        if best is None:
            return None
        if self.affinity is not None and keys:
            holders, _ = self.affinity.holders(keys, set(healthy))
            near = min((healthy[a] for a in holders), key=Replica.score, default=None)
            outcome = "new" if near is None else "busy"
            if near is not None and near.score()[0] <= best.score()[0] + BALANCE:
                best, outcome = near, "cached"
            self.affinity.sent(keys, best.address)
            if self.on_choice is not None:
                self.on_choice(outcome)
        best.chosen = time.monotonic()
        return best

    async def reset_prefix_caches(self, timeout: float = 30.0) -> dict[str, int]:
        """Every replica that reports forgets its cached prefixes, and this router where
        it sent them (a replica that does not report comes back with an empty cache): ->
        the blocks each forgot, by address; grpc.aio.AioRpcError where one could not."""
        if self.affinity is not None:
            self.affinity.clear()
        reporting = self.reporting()
        asked = verifier_pb2.ResetPrefixCacheRequest()
        replies = await asyncio.gather(
            *(r.stub.ResetPrefixCache(asked, timeout=timeout) for r in reporting)
        )
        return {r.address: reply.blocks for r, reply in zip(reporting, replies, strict=True)}

    async def wait_ready(self, timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(r.healthy for r in self.replicas.values()):
                return True
            await asyncio.sleep(0.05)
        return False
