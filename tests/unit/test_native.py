"""Building and loading the native kernels (specd/models/native.py)."""

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specd.models import native


def test_a_build_killed_midway_does_not_hang_the_next_start(cpu_kernels):
    # what torch's loader leaves when its process is killed while building: a `lock` file
    # it would wait on forever
    build = native._build_dir(native.cpu_isa())
    stale = build / "lock"
    stale.touch()
    code = "from specd.models.native import kernel; assert kernel() is not None"
    subprocess.run([sys.executable, "-c", code], timeout=240, check=True)
    # read under the builds' flock: another worker's start, loading the build, holds a
    # `lock` of its own (a live one) while it checks it
    with open(build / "specd.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
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


def test_specd_isa_picks_a_build_this_cpu_runs_and_refuses_one_it_cannot(monkeypatch):
    monkeypatch.setattr(native, "_cpu_flags", lambda: {"avx2", "fma", "f16c"})
    monkeypatch.delenv("SPECD_ISA", raising=False)
    assert native.runnable_isas() == ["avx2"] and native.cpu_isa() == "avx2"
    monkeypatch.setenv("SPECD_ISA", "none")
    assert native.cpu_isa() is None
    monkeypatch.setenv("SPECD_ISA", "avx512")
    with pytest.raises(ValueError, match="SPECD_ISA=avx512: this CPU cannot execute it"):
        native.cpu_isa()
    monkeypatch.setenv("SPECD_ISA", "sse2")
    with pytest.raises(ValueError, match="use one of avx512, avx2 or none"):
        native.cpu_isa()
    avx512 = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
    monkeypatch.setattr(native, "_cpu_flags", lambda: avx512)
    monkeypatch.setenv("SPECD_ISA", "avx2")
    assert native.runnable_isas() == ["avx512", "avx2"] and native.cpu_isa() == "avx2"


def test_an_avx2_run_on_an_avx512_host_takes_an_avx2_hosts_defaults(cpu_kernels):
    """In a process of its own (the choice is made once per process): fp32 activations, an
    fp16 K/V cache, and the AVX2 build loaded."""
    if "avx2" not in native.runnable_isas():
        pytest.skip("this CPU does not run the AVX2 build")
    code = (
        "import torch\n"
        "from specd.models import args, native, paged_kv\n"
        "assert native.cpu_isa() == 'avx2' and native.kernel() is not None\n"
        "dtype = args.default_dtype(torch.device('cpu'))\n"
        "assert dtype == torch.float32, dtype\n"
        "assert paged_kv.kv_dtype('auto', dtype) == torch.float16\n"
        "assert native.kernel().__file__.startswith(str(native._build_dir('avx2')))\n"
    )
    env = {**os.environ, "SPECD_ISA": "avx2"}
    subprocess.run([sys.executable, "-c", code], env=env, timeout=600, check=True)


def test_the_build_command_fails_when_a_build_does_not_compile(monkeypatch, capsys):
    """`make kernels`: every instruction set is compiled; one that fails fails the command
    on a CPU that runs a build, and only warns on one that runs none."""
    monkeypatch.setattr(native, "prebuild", lambda isas: {"avx512": True, "avx2": False})
    monkeypatch.setattr(native, "kernel", lambda: object())
    monkeypatch.setattr(native, "cpu_isa", lambda: "avx512")
    assert native.main([]) == 1
    assert "avx2:FAILED" in capsys.readouterr().out
    monkeypatch.setattr(native, "cpu_isa", lambda: None)
    assert native.main([]) == 0
    monkeypatch.setattr(native, "cpu_isa", lambda: "avx2")
    monkeypatch.setattr(native, "prebuild", lambda isas: {"avx512": True, "avx2": True})
    assert native.main([]) == 0

    def fails():
        raise RuntimeError("does not load")

    monkeypatch.setattr(native, "kernel", fails)  # compiled, but does not load
    assert native.main([]) == 1


def test_a_cpu_that_runs_a_build_and_cannot_build_it_is_an_error(monkeypatch):
    """Not a quiet bf16 fallback many times slower; SPECD_ISA=none is the way to opt out."""

    def no_compiler(isa):
        raise OSError("c++: command not found")

    monkeypatch.setattr(native, "_build", no_compiler)
    monkeypatch.setattr(native, "_kernel_tried", False)
    monkeypatch.setattr(native, "_kernel", None)
    monkeypatch.setattr(native, "runnable_isas", lambda: ["avx2"])
    monkeypatch.delenv("SPECD_ISA", raising=False)
    monkeypatch.delenv("SPECD_NO_QKERNEL", raising=False)
    with pytest.raises(RuntimeError, match=r"could not build .* for avx2 .*command not found"):
        native.kernel()
    monkeypatch.setenv("SPECD_ISA", "none")
    assert native.kernel() is None


def test_the_builds_can_live_apart_from_the_models(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECD_KERNEL_CACHE", str(tmp_path))
    assert native._build_dir("avx2") == tmp_path / native._tag("avx2")
    monkeypatch.delenv("SPECD_KERNEL_CACHE")
    assert native._build_dir("avx2").parent.name == "kernels"
