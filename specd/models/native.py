"""specd's native CPU kernels (`kernels/`: the int8/int4 linear of specd.models.qlinear,
the paged attention of specd.models.attention and the fused element-wise ops of
specd.models.layer_ops, one extension): built once per source, torch version,
instruction set and checkout under $SPECD_CACHE/kernels: for AVX512-VNNI, or for
AVX2 (with FMA and F16C) where the CPU has no AVX512. The AVX512 build also holds an AMX
path for the linear's calls of many rows, taken at run time where the CPU has AMX and the
OS grants it (kernels/qlinear.cpp)."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import subprocess
import sys
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_KERNELS = Path(__file__).with_name("kernels")
_SOURCES = [
    _KERNELS / name
    for name in (  # the slowest first, so that ninja starts them first
        "bindings.cpp",
        "qlinear.cpp",
        "paged_attention.cpp",
        "dense_linear.cpp",
        "layer_ops.cpp",
        "decoder.cpp",
    )
]
_HEADERS = [
    _KERNELS / "bf16.h",
    _KERNELS / "decoder.h",
    _KERNELS / "exp_poly.h",
    _KERNELS / "kv_dtypes.h",
    _KERNELS / "ops.h",
    _KERNELS / "reduce.h",
]  # not compiled on their own, but part of the build's tag
_kernel = None
_kernel_tried = False


@functools.cache
def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((x for x in text.splitlines() if x.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


def cpu_has_vnni() -> bool:
    return {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c"} <= _cpu_flags()


def runnable_isas() -> list[str]:
    """The instruction sets of `_ISA_FLAGS` this CPU can execute, the preferred first."""
    flags = _cpu_flags()
    runs = []
    if cpu_has_vnni():
        runs.append("avx512")
    if {"avx2", "fma", "f16c"} <= flags:
        runs.append("avx2")
    return runs


def cpu_isa() -> str | None:
    """The instruction set the kernels are built for on this CPU: "avx512" (AVX512-VNNI),
    "avx2", or None (neither: the models run bf16). SPECD_ISA picks another build this
    CPU can execute (`avx2` on an AVX512 host runs what an AVX2-only host runs, activation
    defaults included), or `none`."""
    runs = runnable_isas()
    forced = os.environ.get("SPECD_ISA", "").strip().lower()
    if not forced:
        return runs[0] if runs else None
    if forced == "none":
        return None
    if forced not in _ISA_FLAGS:
        raise ValueError(f"SPECD_ISA={forced!r}: use one of {', '.join(_ISA_FLAGS)} or none")
    if forced not in runs:
        runs_text = ", ".join(runs) or "neither"
        raise ValueError(f"SPECD_ISA={forced}: this CPU cannot execute it (it runs {runs_text})")
    return forced


_FLAGS = ["-O3", "-fopenmp", "-mf16c", "-mfma"]
_ISA_FLAGS = {
    "avx512": [f"-mavx512{x}" for x in ("f", "bw", "vl", "vnni")],
    "avx2": ["-mavx2"],
}


def kernel():
    """Build (once, cached under $SPECD_CACHE/kernels) and load the kernels for this CPU
    (`cpu_isa`); None where this CPU runs neither build or the user opted out
    (SPECD_ISA=none, SPECD_NO_QKERNEL=1): the models then run bf16, many times slower. A
    CPU that runs a build and cannot build it (no compiler, no Python headers, a cache
    that cannot be written) is an error, not a quiet fallback."""
    global _kernel, _kernel_tried
    if _kernel_tried:
        return _kernel
    isa = cpu_isa()
    if os.environ.get("SPECD_NO_QKERNEL") or isa is None:
        _kernel_tried = True
        log.warning("no AVX512-VNNI or AVX2 (or SPECD_NO_QKERNEL / SPECD_ISA=none): no CPU kernels")
        return None
    try:
        _kernel = _build(isa)
    except Exception as e:
        raise RuntimeError(
            f"could not build specd's native CPU kernels for {isa} into {_build_dir(isa)}: "
            f"{e}. They need a C++ compiler, Python's headers and a writable $SPECD_CACHE; "
            "SPECD_ISA=none runs without them (bf16, many times slower)"
        ) from e
    _kernel_tried = True
    if _kernel is not None and _kernel.amx_available():
        log.info("int8/int4 kernel: AMX for calls of many rows (SPECD_NO_AMX=1 turns it off)")
    return _kernel


def _tag(isa: str) -> str:
    digest = hashlib.sha256()
    for path in _SOURCES + _HEADERS:
        digest.update(path.read_bytes())
    digest.update(torch.__version__.encode() + isa.encode())
    # torch's loader recompiles everything when the compile command changes, and the
    # command names the sources and torch's headers by absolute path: a checkout or a
    # virtualenv elsewhere (a clean clone) gets a build of its own, instead of rebuilding,
    # inside whichever service starts first, the one every other checkout loads
    digest.update(f"{_KERNELS}\0{Path(torch.__file__).parent}".encode())
    return digest.hexdigest()[:12]


def _build_dir(isa: str) -> Path:
    """$SPECD_KERNEL_CACHE/TAG, by default under $SPECD_CACHE/kernels (an image keeps its
    builds apart from the models, so a volume mounted over the models hides none)."""
    from specd.models.catalog import cache_root

    root = os.environ.get("SPECD_KERNEL_CACHE")
    return (Path(root) if root else cache_root() / "kernels") / _tag(isa)


def _build(isa: str):
    from torch.utils.cpp_extension import load

    build = _build_dir(isa)
    build.mkdir(parents=True, exist_ok=True)
    name = f"specd_qlinear_{_tag(isa)}"
    if not (build / f"{name}.so").exists():
        log.info("building the native kernels for %s into %s (once, about a minute)", isa, build)
    # torch's loader marks a build in progress with a `lock` file and waits, forever, for
    # it to go; a process killed while building (a readiness timeout, the OOM killer)
    # leaves it behind and every later start hangs. Builds here hold an flock, which the
    # OS releases when its holder dies, so whoever holds it knows a `lock` file is stale.
    with open(build / "specd.flock", "w") as held, _own_ninja():
        fcntl.flock(held, fcntl.LOCK_EX)
        (build / "lock").unlink(missing_ok=True)
        return load(
            name=name,
            sources=[str(path) for path in _SOURCES],
            extra_cflags=_FLAGS + _ISA_FLAGS[isa],
            extra_ldflags=["-fopenmp"],
            build_directory=str(build),
            verbose=False,
        )


@contextlib.contextmanager
def _own_ninja():
    """Build with this environment's ninja (the `ninja` package specd depends on), whatever
    PATH says. torch's loader runs the first `ninja` on PATH, and ninja 1.11 and 1.13 hash
    a command differently in their shared log: a build done by one looks changed to the
    other, which recompiles everything. A process started with a virtualenv's bin on PATH
    and one started without (make, a test's subprocess) took turns rebuilding."""
    bin_dir = str(Path(sys.executable).parent)
    saved = os.environ.get("PATH", "")
    if (Path(bin_dir) / "ninja").exists():
        os.environ["PATH"] = os.pathsep.join([bin_dir, saved])
    try:
        yield
    finally:
        os.environ["PATH"] = saved


def prebuild(isas=tuple(_ISA_FLAGS)) -> dict[str, bool]:
    """Build the kernels for each instruction set into the cache, whatever this CPU runs,
    so that an image built on one machine starts at once on another, and so that every
    build is compiled on every host (a change that breaks the build this CPU does not run
    shows here too). torch's loader imports what it builds, and importing the AVX512
    library on an AVX2-only CPU dies of SIGILL, so each build runs in a child process and
    counts as done when its library is on disk. Returns {isa: built}."""
    built = {}
    for isa in isas:
        code = f"from specd.models.native import _build; _build({isa!r})"
        subprocess.run([sys.executable, "-c", code], check=False)
        built[isa] = any(_build_dir(isa).glob("*.so"))
    return built


def main(argv: list[str]) -> int:
    """`python -m specd.models.native` (`make kernels`): compile every instruction set's
    build, then load the one this CPU runs. Fails when a build does not compile, unless
    this CPU runs none of them (there the models run bf16 and nothing needs the kernels).
    `--runnable` prints the builds this CPU can execute instead, the preferred first."""
    if argv == ["--runnable"]:
        print(" ".join(runnable_isas()))
        return 0
    result = prebuild(tuple(argv) or tuple(_ISA_FLAGS))
    print(" ".join(f"{isa}:{'built' if ok else 'FAILED'}" for isa, ok in result.items()))
    isa = cpu_isa()
    if isa is None:
        return 0
    if not all(result.values()):
        return 1
    try:
        kernel()
    except RuntimeError as e:  # compiled, but does not load
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
