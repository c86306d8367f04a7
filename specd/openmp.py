"""How long torch's idle OpenMP workers spin before they sleep, set before torch loads.

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
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

SPIN_COUNT = "30000"


def settle_spinning(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Set libgomp's spin count for a model service unless the user chose how OpenMP
    waits; True if it was set. Must run before torch is imported: libgomp reads its
    environment once, when it loads."""
    if "GOMP_SPINCOUNT" in environ or "OMP_WAIT_POLICY" in environ:
        return False
    environ["GOMP_SPINCOUNT"] = SPIN_COUNT
    return True
