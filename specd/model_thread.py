"""The one thread of a service process that runs torch: model loading, steps, draft rounds.

Why one: libgomp (torch's OpenMP on Linux) gives every calling thread its own team of
workers, and once the process holds more OpenMP threads than it has CPUs it "throttles":
an idle worker spins ~100 times instead of ~300,000 before it sleeps, so every parallel
region (hundreds per forward) pays a futex wake-up. Loading the weights on the main thread
and stepping on an executor thread was enough to trigger it: on 2 cores each draft round
and verification forward ran ~25% slower than the same code on the main thread. Loading
and stepping on this single thread keeps one team per process. (Between processes, the
drafter's and the verifier's teams taking turns on the same cores: specd/openmp.py.)

The thread is per role ("drafter", "verifier"): a service process has one role, and the
tests that run all services in one process must not have the verifier's step wait on the
drafter's round behind it on the same thread.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

_threads: dict[str, ThreadPoolExecutor] = {}
_lock = threading.Lock()


def model_thread(role: str) -> ThreadPoolExecutor:
    with _lock:
        if role not in _threads:
            _threads[role] = ThreadPoolExecutor(max_workers=1, thread_name_prefix=role)
        return _threads[role]


async def on_model_thread(role: str, fn, *args):
    """Await fn(*args) on the role's model thread (the event loop keeps serving)."""
    return await asyncio.get_running_loop().run_in_executor(model_thread(role), fn, *args)
