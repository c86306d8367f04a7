"""Quantised matrices moved into transparent huge pages (2 MiB) on Linux.

A decode step streams every matrix once (~1 GB for the 1.5B target at 4 bits). Mapped from
the weight cache file, that memory comes in 4 KiB pages, or in whatever folios the page
cache happened to hold: docs/benchmarks-log.md section 35 found 63 MB of the target's 987 MB mapped
in 2 MiB pages, where llama.cpp (which maps its GGUF with MAP_POPULATE after
POSIX_FADV_SEQUENTIAL) had 991 of 1085 MB. Copied into one anonymous region advised
MADV_HUGEPAGE, a forward took ~1-2% less time (median of paired rounds in one process).

What it costs: the copy (a fraction of a second at start), and replicas of one model on a
host no longer share the file's pages. Resident memory stays the same: the mapped file's
pages counted there too once a step had read them, and the embedding, of which a step
reads a row or two, stays mapped from the file (the loader maps it afresh, so that the
pages the copy read go with the first mapping). Nor does the load's peak: each matrix's
file pages are let go as soon as it is copied. Where the kernel's THP mode is `never`,
or off Linux, the weights stay where they are.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import sys
from pathlib import Path

import torch

from specd.models.qlinear import QWeight

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
# below this a region is mostly its alignment padding and a huge page mostly empty (the
# tiny test models): those weights stay where they are
MIN_BYTES = 8 * HUGE_PAGE
_ALIGN = 64  # each matrix's records start on a cache line
_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def available() -> bool:
    """Can an anonymous mapping ask for huge pages here (Linux, THP not `never`)?"""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        return "[never]" not in _MODE.read_text()
    except OSError:
        return False


def place(weights: list[QWeight], min_bytes: int | None = None) -> int:
    """Copy the matrices' records into one 2 MiB-aligned anonymous region advised
    MADV_HUGEPAGE, and point each QWeight at its copy (the values are the same bytes).
    Returns the bytes placed: 0 where huge pages are not available or the matrices come to
    less than `min_bytes` (default `MIN_BYTES`). The region lives as long as a view of it
    does."""
    weights = [w for w in weights if w.records.device.type == "cpu"]
    sizes = [-(-w.records.numel() // _ALIGN) * _ALIGN for w in weights]
    if not weights or sum(sizes) < (MIN_BYTES if min_bytes is None else min_bytes):
        return 0
    if not available():
        return 0
    region = mmap.mmap(-1, sum(sizes) + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)  # before the first touch: the copy faults them in
    flat = torch.frombuffer(region, dtype=torch.uint8)  # holds a reference to the region
    offset = -flat.data_ptr() % HUGE_PAGE
    files = _file_mappings()
    for w, size in zip(weights, sizes, strict=True):
        copy = flat[offset : offset + w.records.numel()].view(w.records.shape)
        copy.copy_(w.records)
        _drop_file_pages(w.records, files)
        w.records = copy
        offset += size
    return sum(sizes)


def _file_mappings() -> list[tuple[int, int]]:
    """This process's mappings of files, as (start, end) addresses (/proc/self/maps: an
    inode other than 0)."""
    out = []
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        fields = line.split()
        if len(fields) >= 6 and fields[4] != "0":
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            out.append((lo, hi))
    return out


def _drop_file_pages(t: torch.Tensor, files: list[tuple[int, int]]) -> None:
    """Once a matrix is copied, let go of its source's pages where they are a file's: the
    copy and the mapped file would otherwise both be resident until the loader drops the
    file's mapping, and the load's peak would be twice the weights (the 1.5B target:
    2236 MB at load against 1650 MB in service, docs/benchmarks-log.md section 39).
    MADV_DONTNEED on a file's (unwritten) pages only unmaps them: a later read faults them
    in from the file again. Anonymous memory (weights converted in this process) is left
    alone, as DONTNEED would zero it."""
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    if not any(lo <= start and end <= hi for lo, hi in files):
        return
    page = mmap.PAGESIZE
    lo, hi = -(-start // page) * page, end // page * page  # the whole pages inside it
    if hi > lo:
        _libc().madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), mmap.MADV_DONTNEED)


@functools.cache
def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def place_model(model) -> int:
    """A quantised CPU model's layer matrices in one region and its LM head in another (a
    drafter trims its head later and places the trimmed one: `place_head`); the bytes
    placed. An untied embedding stays where it is: a step reads a row or two of it (the
    loader maps it afresh, specd.models.weights.map_matrix)."""
    placed = place_layers(model) + place_head(model)
    if placed:
        log.info("weights in huge pages: %d MiB", placed >> 20)
    return placed


def place_layers(model) -> int:
    """The layer matrices in one region (again, after some were replaced: the region
    before goes once nothing points into it); the bytes placed."""
    layers = [
        part
        for layer in model.layers
        for w in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)
        for part in (w if isinstance(w, list) else [w])
        if isinstance(part, QWeight)
    ]
    model._stack = None  # a native stack built before holds the old records
    return place(layers)


def place_head(model) -> int:
    """The LM head, read whole every step (a tied one is the embedding: placed too)."""
    return place([model.lm_head]) if isinstance(model.lm_head, QWeight) else 0
