"""Building and loading the native kernels (specd/models/native.py)."""

import os
import subprocess
import sys
from pathlib import Path

from specd.models import native


def test_a_build_killed_midway_does_not_hang_the_next_start(cpu_kernels):
    # what torch's loader leaves when its process is killed while building: a `lock` file
    # it would wait on forever
    stale = native._build_dir(native.cpu_isa()) / "lock"
    stale.touch()
    code = "from specd.models.native import kernel; assert kernel() is not None"
    subprocess.run([sys.executable, "-c", code], timeout=240, check=True)
    assert not stale.exists()


def test_the_build_tag_covers_the_headers_and_the_instruction_set():
    assert native._HEADERS and all(h.exists() for h in native._HEADERS + native._SOURCES)
    assert native._tag("avx512") != native._tag("avx2")


def test_a_checkout_elsewhere_gets_a_build_of_its_own(monkeypatch, tmp_path):
    # torch's loader names the sources by absolute path in its compile command and
    # recompiles when that changes, so two checkouts sharing one build would rebuild it
    # in turn, inside whichever service started first
    here = native._tag("avx2")
    monkeypatch.setattr(native, "_KERNELS", tmp_path / "kernels")
    assert native._tag("avx2") != here


def test_a_second_start_loads_the_build_whatever_its_path(cpu_kernels):
    # a service started with the virtualenv's bin on PATH (its ninja) and one started
    # without (the system's) must both load the library already built, not recompile it
    library = next(native._build_dir(native.cpu_isa()).glob("*.so"))
    built = library.stat().st_mtime_ns
    code = "from specd.models.native import kernel; assert kernel() is not None"
    venv_first = os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])
    for path in (venv_first, "/usr/local/bin:/usr/bin:/bin"):
        env = {**os.environ, "PATH": path}
        subprocess.run([sys.executable, "-c", code], env=env, timeout=240, check=True)
    assert library.stat().st_mtime_ns == built
