"""specd services as child processes on loopback ports (`specd serve ROLE`), for the soak
benchmark and the fault tests: started, health-checked, SIGKILLed, restarted on the same
port, their memory and Prometheus metrics read.

Each process logs to a file; a start that fails raises with the end of that log, so a
broken server explains itself.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from specd.channels import check_health

ROUTER_READY = "specd.v1.Generation"  # the router's readiness: some verifier is healthy


_handed_out: set[int] = set()
_pick = random.Random()  # its own seed: a test that seeds `random` makes no two pickers agree


def free_port() -> int:
    """A loopback port nobody listens on, for a process about to be started. It is drawn
    below the kernel's ephemeral range, where no `bind(port 0)` or outgoing connection can
    take it in the seconds before the process binds it, and never twice in this process
    (past 10,000 draws that find none, the kernel's pick)."""
    low = _ephemeral_low()
    draws = 0
    while True:
        draws += 1
        port = _pick.randrange(low - 10_000, low) if low > 11_024 and draws <= 10_000 else 0
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            port = s.getsockname()[1]
        _handed_out.add(port)
        return port


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


class ServerProcess:
    def __init__(
        self,
        role: str,
        *flags: str,
        logs: Path,
        ready_service: str = "",
        port: int = 0,
        env: dict[str, str] | None = None,
    ):
        """`env`: variables set for the process on top of this one's environment."""
        self.role = role
        self.flags = list(flags)
        self.env = env
        self.port = port or free_port()
        self.ready_service = ready_service
        self.log_path = logs / f"{role}-{self.port}.log"
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 90.0) -> ServerProcess:
        """Launch the process and return once it is healthy."""
        return self.launch().wait_ready(timeout)

    def launch(self) -> ServerProcess:
        """Start the process and return at once (`wait_ready` waits for its health)."""
        cmd = [sys.executable, "-m", "launcher", "serve", self.role]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), *self.flags]
        with open(self.log_path, "a") as log:
            env = {**os.environ, **self.env} if self.env else None
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        return self

    def wait_ready(self, timeout: float = 90.0) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.role} exited {self.proc.returncode}:\n{self.log()}")
            if check_health(self.address, timeout=1.0, service=self.ready_service):
                return self
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"{self.role} not healthy after {timeout}s:\n{self.log()}")

    def kill(self) -> None:
        """SIGKILL: no shutdown handler runs, connections just drop."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()

    def rss_bytes(self) -> int:
        """Resident memory of the process now (Linux /proc)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def log(self, tail: int = 4000) -> str:
        return self.log_path.read_text()[-tail:] if self.log_path.exists() else ""


def start_together(*processes: ServerProcess, timeout: float = 90.0) -> None:
    """Launch every process at once, then wait for each to be healthy: their starts
    (importing torch, loading a model) overlap. Each waits for what it depends on by itself
    (a verifier for its drafter, a router for a healthy verifier)."""
    for p in processes:
        p.launch()
    try:
        for p in processes:
            p.wait_ready(timeout)
    except BaseException:
        stop_all(*processes)
        raise


def stop_all(*processes: ServerProcess) -> None:
    for p in processes:
        p.stop()


def scrape(port: int, name: str) -> float:
    """Sum of a metric's samples (all labels) from a service's Prometheus endpoint."""
    from urllib.request import urlopen

    from prometheus_client.parser import text_string_to_metric_families

    text = urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in (name, name + "_total"):
                total += sample.value
    return total


def start_services(
    model: str,
    draft_model: str,
    dtype: str,
    logs: Path,
    proposer: str = "draft",
    drafter_flags: tuple[str, ...] = (),
    router_flags: tuple[str, ...] = (),
) -> dict:
    """Drafter, verifier and router as child processes on free loopback ports, with
    Prometheus endpoints on the drafter and verifier. Returns them by role, plus
    `drafter_metrics_port`. `drafter_flags` and `router_flags` go to `specd serve drafter`
    and `specd serve router` as they are."""
    drafter_metrics, verifier_metrics = free_port(), free_port()
    drafter = ServerProcess(
        "drafter",
        *("--dtype", dtype, "--model", draft_model, "--proposer", proposer),
        *("--metrics-port", str(drafter_metrics)),
        *drafter_flags,
        logs=logs,
    )
    verifier = ServerProcess(
        "verifier",
        *("--dtype", dtype, "--model", model, "--drafter", drafter.address),
        *("--metrics-port", str(verifier_metrics)),
        logs=logs,
    )
    router = ServerProcess(
        "router",
        *("--tokenizer", model, "--verifier", verifier.address),
        *router_flags,
        logs=logs,
        ready_service=ROUTER_READY,
    )
    start_together(drafter, verifier, router, timeout=300)
    try:  # a verifier serves without a drafter that takes long to load: wait for it here
        wait_for_drafter(verifier.address)
    except BaseException:
        stop_all(router, verifier, drafter)
        raise
    return {
        "drafter": drafter,
        "verifier": verifier,
        "router": router,
        "drafter_metrics_port": drafter_metrics,
    }


def replace_drafter(services: dict, draft_model: str, dtype: str, proposer: str, logs: Path):
    """Stop the drafter and start one with another proposer on the same port; returns once
    the verifier's drafter stream is back (its load report says so)."""
    old = services["drafter"]
    old.stop()
    services["drafter"] = ServerProcess(
        "drafter",
        *("--dtype", dtype, "--model", draft_model, "--proposer", proposer),
        logs=logs,
        port=old.port,
    ).start(timeout=300)
    wait_for_drafter(services["verifier"].address)


def lookup_in_verifier(services: dict, logs: Path, timeout: float = 300) -> None:
    """Stop the drafter and restart the verifier on its port with a lookup of its own
    (`--lookup`), as `specd up` runs vLLM's ngram method: no drafter process, no round trip
    a round. Returns once the router serves through the new verifier."""
    router, old = services["router"], services["verifier"]
    services["drafter"].stop()
    old.stop()
    deadline = time.monotonic() + 30  # the router sees it gone before the new one starts
    while check_health(router.address, timeout=1.0, service=ROUTER_READY):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the router at {router.address} still serves a stopped verifier")
        time.sleep(0.2)
    at = old.flags.index("--drafter")
    flags = [*old.flags[:at], *old.flags[at + 2 :], "--lookup"]
    services["verifier"] = ServerProcess("verifier", *flags, logs=logs, port=old.port)
    services["verifier"].start(timeout)
    router.wait_ready(timeout)


def wait_for_drafter(verifier: str, timeout: float = 60) -> None:
    """Until the verifier's drafter stream is up (its load report says so) and the router
    has seen that in a load report (every ~100 ms)."""
    deadline = time.monotonic() + timeout
    while not verifier_load(verifier).drafter_available:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the verifier at {verifier} did not connect to its drafter")
        time.sleep(0.2)
    time.sleep(0.5)


def verifier_load(address: str):
    """The verifier's current load report (`WatchLoad`'s first message)."""
    import grpc

    from protos.specd.v1 import verifier_pb2, verifier_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = verifier_pb2_grpc.VerifierStub(channel)
        return next(iter(stub.WatchLoad(verifier_pb2.WatchLoadRequest(), timeout=5)))


@contextlib.contextmanager
def services_running(model: str, draft_model: str, dtype: str, prefix: str, **flags):
    """`start_services` for the length of a `with` block (logs in a fresh temp folder);
    all three are stopped on the way out."""
    logs = Path(tempfile.mkdtemp(prefix=prefix))
    services = start_services(model, draft_model, dtype, logs, **flags)
    try:
        yield services
    finally:
        for role in ("router", "verifier", "drafter"):
            services[role].stop()
