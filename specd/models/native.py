"""specd's native CPU kernels (`kernels/`: the int8/int4 linear of specd.models.qlinear
and the paged attention of specd.models.attention, one extension): built once per source
and torch version under $SPECD_CACHE/kernels, loaded where the CPU has AVX512-VNNI."""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_KERNELS = Path(__file__).with_name("kernels")
_SOURCES = [_KERNELS / name for name in ("qlinear.cpp", "paged_attention.cpp", "bindings.cpp")]
_kernel = None
_kernel_tried = False


def cpu_has_vnni() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return all(f in flags for f in ("avx512f", "avx512bw", "avx512_vnni", "f16c"))


_FLAGS = ["-O3", "-fopenmp", "-mf16c", "-mfma"]
_FLAGS += [f"-mavx512{x}" for x in ("f", "bw", "vl", "vnni")]


def kernel():
    """Build (once, cached under $SPECD_CACHE/kernels) and load the AVX512-VNNI kernels
    (this linear, and specd.models.attention's); None where this CPU or toolchain cannot
    run them."""
    global _kernel, _kernel_tried
    if _kernel_tried:
        return _kernel
    _kernel_tried = True
    # SPECD_BUILD_QKERNEL: build (and load, never run) where this CPU could not run it,
    # so an image build leaves the compiled kernel in the image's cache
    runnable = cpu_has_vnni() or os.environ.get("SPECD_BUILD_QKERNEL")
    if os.environ.get("SPECD_NO_QKERNEL") or not runnable:
        log.warning("no AVX512-VNNI on this CPU (or SPECD_NO_QKERNEL set): no int8/int4 kernel")
        return None
    try:
        _kernel = _build()
    except Exception as e:  # no compiler, no headers: the model runs bf16 (weights.choose)
        log.warning("could not build the int8/int4 kernel (%s)", e)
        _kernel = None
    return _kernel


def _build():
    from torch.utils.cpp_extension import load

    from specd.models.catalog import cache_root

    src = b"".join(path.read_bytes() for path in _SOURCES)
    tag = hashlib.sha256(src + torch.__version__.encode()).hexdigest()[:12]
    build = cache_root() / "kernels" / tag
    build.mkdir(parents=True, exist_ok=True)
    return load(
        name=f"specd_qlinear_{tag}",
        sources=[str(path) for path in _SOURCES],
        extra_cflags=_FLAGS,
        extra_ldflags=["-fopenmp"],
        build_directory=str(build),
        verbose=False,
    )
