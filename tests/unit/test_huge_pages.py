"""Quantised matrices moved into huge pages: the same bytes, in one 2 MiB-aligned region
advised MADV_HUGEPAGE, and a model that computes the same bits after the move."""

import pytest
import torch

from specd.models import huge_pages
from specd.models.loader import load_model
from specd.models.qlinear import QWeight, quantize
from tests.unit.test_drafter_cuts import PROMPT, prefill_logits

pytestmark = pytest.mark.usefixtures("cpu_kernels")


@pytest.fixture
def advisable(monkeypatch):
    """Placement on whatever THP mode this host is set to: MADV_HUGEPAGE is accepted
    wherever the kernel has THP at all, `never` included (the pages then stay small, the
    region and its advice are the same), so the copy is tested on every Linux CI host."""
    if not huge_pages._MODE.exists():
        pytest.skip("this kernel has no transparent huge pages")
    monkeypatch.setattr(huge_pages, "available", lambda: True)


def _smaps(address: int, field: str) -> list[str]:
    """A field of /proc/self/smaps for this process's mapping that holds `address`."""
    lines = open("/proc/self/smaps").read().splitlines()
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith(field + ":"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def _vm_flags(address: int) -> list[str]:
    return _smaps(address, "VmFlags")


def _resident_kb(address: int) -> int:
    return int(_smaps(address, "Rss")[0])


def test_place_copies_the_bytes_into_one_aligned_advised_region(advisable):
    gen = torch.Generator().manual_seed(0)
    mats = [
        quantize(torch.randn(n, k, generator=gen) * 0.02, bits)
        for n, k, bits in ((256, 512, 4), (48, 512, 6), (32, 256, 8), (1024, 1024, 4))
    ]
    before = [w.records.clone() for w in mats]
    sources = [w.records for w in mats]
    placed = huge_pages.place(mats, min_bytes=0)
    assert placed >= sum(b.numel() for b in before)
    for w, src, b in zip(mats, sources, before, strict=True):
        assert torch.equal(w.records, b)
        assert torch.equal(src, b)  # anonymous sources keep their bytes (no DONTNEED)
    starts = [w.records.data_ptr() for w in mats]
    assert starts[0] % huge_pages.HUGE_PAGE == 0
    assert all(s % 64 == 0 for s in starts)
    ends = [s + w.records.numel() for s, w in zip(starts, mats, strict=True)]
    assert all(e <= s for e, s in zip(ends, starts[1:], strict=False))  # in order, apart
    assert "hg" in _vm_flags(starts[0])  # MADV_HUGEPAGE on the region


def test_a_file_mapped_source_gives_its_pages_back(tmp_path, advisable):
    """The load's peak: once a matrix mapped from its cache file is copied, the process
    stops holding the file's pages (before, the 1.5B target peaked at 2166 MB while loading
    against 1212 MB loaded), and a read of the old view still finds the file's bytes."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    w = quantize(torch.randn(2048, 2048) * 0.02, 4)  # ~2.3 MB of records
    save_file({"w": w.records}, tmp_path / "w.safetensors")
    with safe_open(tmp_path / "w.safetensors", framework="pt") as f:
        mapped = f.get_tensor("w")
    expected = mapped.clone()  # reads every page: all resident now
    source = QWeight(mapped, w.bits, w.shape)
    ptr = mapped.data_ptr()
    resident = _resident_kb(ptr)
    assert resident >= mapped.numel() // 1024 - 8
    assert huge_pages.place([source], min_bytes=0)
    assert torch.equal(source.records, expected)
    assert _resident_kb(ptr) <= 8  # at most the partial pages at its two ends
    assert torch.equal(mapped, expected)  # faulted in from the file again


def test_without_huge_pages_nothing_moves(monkeypatch):
    monkeypatch.setattr(huge_pages, "available", lambda: False)
    w = quantize(torch.randn(1024, 1024) * 0.02, 4)
    ptr = w.records.data_ptr()
    assert huge_pages.place([w], min_bytes=0) == 0
    assert w.records.data_ptr() == ptr


def test_small_sets_stay_where_they_are(advisable):
    w = quantize(torch.randn(64, 256) * 0.02, 4)
    ptr = w.records.data_ptr()
    assert huge_pages.place([w]) == 0  # below MIN_BYTES
    assert w.records.data_ptr() == ptr


def test_a_placed_model_computes_the_same_bits(tiny, monkeypatch, advisable):
    """Through the loader: layers and head in the region, the embedding mapped afresh from
    the cache file, and the logits those of the model left where it was."""
    folder, _ = tiny
    monkeypatch.setattr(huge_pages, "MIN_BYTES", 0)
    with monkeypatch.context() as m:
        m.setattr(huge_pages, "available", lambda: False)
        left = load_model(folder, dtype="fp32", device="cpu", weights="int4")
    placed = load_model(folder, dtype="fp32", device="cpu", weights="int4")
    assert "hg" in _vm_flags(placed.layers[0].w_gate_up.records.data_ptr())
    assert "hg" in _vm_flags(placed.lm_head.records.data_ptr())
    if placed.embed is not placed.lm_head:
        assert "hg" not in _vm_flags(placed.embed.records.data_ptr())
    expected = prefill_logits(left, PROMPT, one_by_one_from=6)
    assert torch.equal(prefill_logits(placed, PROMPT, one_by_one_from=6), expected)
