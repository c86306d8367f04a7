"""A one-line progress bar on stderr for the benchmarks (no dependency)."""

from __future__ import annotations

import sys


def progress_bar(label: str, width: int = 40):
    """Returns `update(done, total, note="")`, redrawing `label [####....] done/total note`."""

    def update(done: int, total: int, note: str = "") -> None:
        filled = width * done // max(total, 1)
        bar = "#" * filled + "." * (width - filled)
        sys.stderr.write(f"\r  {label} [{bar}] {done}/{total} {note}\033[K")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()

    return update
