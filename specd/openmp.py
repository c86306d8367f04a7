"""How many threads a model service runs and how long its idle OpenMP workers spin before
they sleep, both set before torch loads.

Threads: torch and libgomp start a worker per core the process may run on, which in a
pod is every core of the node, whatever the pod's CPU limit: 64 workers time-sliced onto a
limit of 4 CPUs. `settle_threads` sets OMP_NUM_THREADS (read by both) from the cgroup's
CPU quota, rounded up, unless the user set it.

Spinning:

On Linux torch runs its parallel regions on libgomp. After a region its idle workers
busy-wait GOMP_SPINCOUNT spins (300,000 when unset, some milliseconds) before they sleep
on a futex, so that the next region starts without a wake-up. Within one process that is
what we want: a forward runs hundreds of regions back to back. But the drafter and the
verifier take turns on the same cores, and each round one process's workers go on
spinning while the other's forward runs, taking the CPU from it. Measured on 2 cores with
the two models in strict alternation, as in a draft round (docs/benchmarks-log.md section 34): a
drafter forward took ~21 ms against ~15 ms alone, and a 4-row verification ~47 ms against
~41 ms. With 30,000 spins (a tenth of the default, still longer than the gaps between
the regions of one forward) both ran about as fast as alone, and a plain forward alone was
no slower; 10,000 made the plain forward ~5% slower on average.

Each process's spinning slows the other, so both spin short: the drafter, and a verifier
that has a drafter. A verifier without one keeps libgomp's default: nothing takes turns
with it, and in some runs through the API its plain steps were 3-8% faster with the
default (not in others; section 34). OMP_WAIT_POLICY=PASSIVE (no spinning) is no
answer: every region then pays a wake-up (a plain step went from ~31 to 47 ms, section
33). A user's own GOMP_SPINCOUNT or OMP_WAIT_POLICY always wins.

Where torch was loaded before a service could set these (a sitecustomize, a wrapper that
imports torch first), libgomp keeps what it read then, and the service says so at start
(`too_late`): with the default spin, `auto` at chat c = 2 went from 1.13-1.22x `off` to
0.95-1.0x (section 68).
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Mapping, MutableMapping
from pathlib import Path

SPIN_COUNT = "30000"


def too_late(settled: list[str], modules: Mapping[str, object] = sys.modules) -> str:
    """A warning for a model service that set the `settled` variables after torch was
    loaded (libgomp read its environment then, and keeps it); "" when torch was not
    loaded yet or nothing was set."""
    if not settled or "torch" not in modules:
        return ""
    names = " and ".join(settled)
    return (
        f"torch was loaded before this service set {names} (a sitecustomize or a wrapper "
        "that imports torch first?), so OpenMP runs without them: drafting rounds and "
        f"verification slow each other down. Set {names} in the environment, or import "
        "nothing before `specd serve`."
    )


def settle_spinning(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Set libgomp's spin count for a model service unless the user chose how OpenMP
    waits; True if it was set. Must run before torch is imported: libgomp reads its
    environment once, when it loads."""
    if "GOMP_SPINCOUNT" in environ or "OMP_WAIT_POLICY" in environ:
        return False
    environ["GOMP_SPINCOUNT"] = SPIN_COUNT
    return True


CGROUP = Path("/sys/fs/cgroup")


def cpu_limit(root: Path = CGROUP) -> float | None:
    """The CPUs this process's cgroup may use (a container's CPU limit): cgroup v2's
    `cpu.max` ("quota period"), or v1's `cpu.cfs_quota_us` / `cpu.cfs_period_us`; None
    where there is no limit."""
    try:
        quota, period = (root / "cpu.max").read_text().split()
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    for folder in (root / "cpu", root / "cpu,cpuacct"):
        try:
            quota = int((folder / "cpu.cfs_quota_us").read_text())
            period = int((folder / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        return None if quota <= 0 else quota / period
    return None


def usable_cores(root: Path = CGROUP) -> int:
    """The cores this process may run on, capped by its cgroup's CPU limit (rounded up)."""
    return _cap_by_limit(len(os.sched_getaffinity(0)), cpu_limit(root))


def _cap_by_limit(cores: int, limit: float | None) -> int:
    return cores if limit is None else max(1, min(cores, math.ceil(limit)))


def settle_threads(environ: MutableMapping[str, str] = os.environ, root: Path = CGROUP) -> str:
    """Set OMP_NUM_THREADS for a model service to its `usable_cores`, unless the user set
    it. Must run before torch is imported. Returns a line saying what the service runs
    with, for its start log."""
    if "OMP_NUM_THREADS" in environ:
        return f"{environ['OMP_NUM_THREADS']} threads (OMP_NUM_THREADS, set by the user)"
    cores = len(os.sched_getaffinity(0))
    limit = cpu_limit(root)
    threads = _cap_by_limit(cores, limit)
    environ["OMP_NUM_THREADS"] = str(threads)
    source = "no CPU limit" if limit is None else f"a CPU limit of {limit:g}"
    return f"{threads} threads ({cores} cores to run on, {source})"
