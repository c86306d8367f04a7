"""`specd up`'s supervisor: keeps the local cluster's processes running.

Each child runs under its own anyio task: started, polled until its gRPC health service
says SERVING, and, once it has been ready, started again with back-off whenever it exits,
while the others keep serving (a verifier decodes without drafts while its drafter is down;
the router sends to the other replicas while a verifier is). A child that exits before it
was ever ready stops the cluster: a bad flag or a missing model does not fix itself.
SIGINT and SIGTERM stop every child: SIGTERM, which lets the services drain, then SIGKILL
after the grace period. Every start, exit and stop is one line on stderr.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio

from specd.channels import check_health


@dataclass
class Child:
    role: str  # "drafter", "verifier", "verifier-2", "router"
    argv: list[str]
    address: str
    ready_service: str = ""  # the health service that says it can serve ("": overall)
    env: dict[str, str] = field(default_factory=dict)  # set on top of up's environment
    ever_ready: bool = False
    restarts: int = 0


@dataclass(frozen=True)
class Backoff:
    first_s: float = 1.0
    max_s: float = 30.0
    stable_s: float = 60.0  # a child that ran this long is restarted after first_s again

    def delay(self, failures: int) -> float:
        """Wait before restart number `failures + 1` of a child that keeps failing."""
        return min(self.max_s, self.first_s * 2**failures)


def say(message: str) -> None:
    print(f"specd up: {message}", file=sys.stderr, flush=True)


class Supervisor:
    def __init__(
        self,
        children: list[Child],
        ready_timeout: float = 600.0,
        grace_s: float = 10.0,
        backoff: Backoff = Backoff(),
        on_ready: Callable[[], None] = lambda: None,
    ):
        self.children = children
        self.ready_timeout = ready_timeout
        self.grace_s = grace_s
        self.backoff = backoff
        self.on_ready = on_ready
        self.exit_code = 0
        self._all_ready = anyio.Event()
        self._group: anyio.abc.TaskGroup | None = None

    def run(self) -> int:
        return anyio.run(self._run)

    async def _run(self) -> int:
        async with anyio.create_task_group() as group:
            self._group = group
            group.start_soon(self._signals)
            group.start_soon(self._startup)
            for child in self.children:
                group.start_soon(self._keep, child)
        say(f"stopped (exit {self.exit_code})")
        return self.exit_code

    def _stop(self, code: int, why: str) -> None:
        say(why)
        self.exit_code = code
        self._group.cancel_scope.cancel()

    async def _signals(self) -> None:
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                self._stop(0, f"{signal.Signals(signum).name}: stopping every process")
                return

    async def _startup(self) -> None:
        with anyio.move_on_after(self.ready_timeout):
            await self._all_ready.wait()
            self.on_ready()
            return
        pending = [c.role for c in self.children if not c.ever_ready]
        self._stop(1, f"not ready after {self.ready_timeout:.0f} s: {', '.join(pending)}")

    async def _keep(self, child: Child) -> None:
        failures = 0
        while True:
            started = anyio.current_time()
            code = await self._run_once(child)
            if not child.ever_ready:
                self._stop(1, f"{child.role} exited with {code} before it was ready")
                return
            if anyio.current_time() - started >= self.backoff.stable_s:
                failures = 0
            delay = self.backoff.delay(failures)
            failures += 1
            child.restarts += 1
            say(f"{child.role} exited with {code}; restart {child.restarts} in {delay:.0f} s")
            await anyio.sleep(delay)

    async def _run_once(self, child: Child) -> int:
        """Start the child, announce it once ready, return its exit code; on cancellation
        stop it (SIGTERM, SIGKILL after the grace period)."""
        env = {**os.environ, **child.env} if child.env else None
        proc = await anyio.open_process(
            child.argv, stdin=subprocess.DEVNULL, stdout=None, stderr=None, env=env
        )
        try:
            async with anyio.create_task_group() as watch:
                watch.start_soon(self._announce_ready, child, proc.pid)
                code = await proc.wait()
                watch.cancel_scope.cancel()
            return code
        finally:
            with anyio.CancelScope(shield=True):
                await self._terminate(proc)

    async def _announce_ready(self, child: Child, pid: int) -> None:
        while not await anyio.to_thread.run_sync(
            lambda: check_health(child.address, timeout=0.5, service=child.ready_service)
        ):
            await anyio.sleep(0.5)
        again = " again" if child.ever_ready else ""
        say(f"{child.role} ready{again} on {child.address} (pid {pid})")
        child.ever_ready = True
        if all(c.ever_ready for c in self.children):
            self._all_ready.set()

    async def _terminate(self, proc) -> None:
        if proc.returncode is not None:
            return
        proc.terminate()
        with anyio.move_on_after(self.grace_s):
            await proc.wait()
            return
        proc.kill()
        await proc.wait()
