"""libgomp's spin count for the model services (specd/openmp.py): set before torch loads,
never over the user's own choice."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import pytest

from specd.openmp import SPIN_COUNT, cpu_limit, settle_spinning, settle_threads, too_late


def test_a_service_environment_gets_the_short_spin():
    env = {"PATH": "/bin"}
    assert settle_spinning(env)
    assert env == {"PATH": "/bin", "GOMP_SPINCOUNT": SPIN_COUNT}


@pytest.mark.parametrize(
    "name,value", [("GOMP_SPINCOUNT", "300000"), ("OMP_WAIT_POLICY", "ACTIVE")]
)
def test_the_users_own_openmp_waiting_wins(name, value):
    env = {name: value}
    assert not settle_spinning(env)
    assert env == {name: value}


# `specd serve <role>` in a fresh interpreter, with the role's server module replaced by
# one that records, when it is imported (the point where the real one loads torch), what
# libgomp would read
_SERVE = textwrap.dedent(
    """
    import importlib.abc, importlib.machinery, os, sys
    seen = []

    class Server(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, path, target=None):
            if name in ("drafter_service.server", "verifier_service.startup"):
                return importlib.machinery.ModuleSpec(name, self)

        def create_module(self, spec):
            return None

        def exec_module(self, module):
            seen.append(
                (os.environ.get("GOMP_SPINCOUNT"), os.environ.get("OMP_NUM_THREADS"),
                 "torch" in sys.modules)
            )  # fmt: skip

            async def serve(config):
                pass

            module.serve = serve

    sys.meta_path.insert(0, Server())
    from launcher.cli import main

    main(sys.argv[1:])
    print(seen)
    """
)


@pytest.mark.parametrize(
    "argv,spin",
    [
        (["serve", "drafter", "--model", "small"], SPIN_COUNT),
        (["serve", "verifier", "--model", "small", "--drafter", "127.0.0.1:1"], SPIN_COUNT),
        (["serve", "verifier", "--model", "small"], None),  # no drafter to take turns with
    ],
)
def test_serve_sets_the_spin_count_and_threads_before_torch_loads(argv, spin, monkeypatch):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    out = subprocess.run(
        [sys.executable, "-c", _SERVE, *argv], capture_output=True, text=True, check=True
    )
    threads = str(len(os.sched_getaffinity(0)))  # this host: no CPU limit below its cores
    if cpu_limit() is not None:
        threads = str(max(1, min(int(threads), math.ceil(cpu_limit()))))
    assert out.stdout.strip() == repr([(spin, threads, False)])
    assert f"{threads} threads" in out.stderr  # logged at start
    assert "torch was loaded before" not in out.stderr


def _serve_after_torch(env: dict[str, str]) -> subprocess.CompletedProcess:
    """`specd serve drafter` in an interpreter that imported torch first, as a
    sitecustomize or a wrapper script would."""
    argv = ["serve", "drafter", "--model", "small"]
    return subprocess.run(
        [sys.executable, "-c", "import torch\n" + _SERVE, *argv],
        capture_output=True, text=True, check=True, env=env,
    )  # fmt: skip


def test_a_service_started_after_torch_loaded_says_its_openmp_settings_do_not_hold():
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_NUM_THREADS")}
    env.pop("OMP_WAIT_POLICY", None)
    out = _serve_after_torch(env)
    assert "torch was loaded before this service set OMP_NUM_THREADS and GOMP_SPINCOUNT" in (
        out.stderr
    )
    # the user's own settings were in the environment when torch loaded: nothing to say
    out = _serve_after_torch(dict(env, GOMP_SPINCOUNT="300000", OMP_NUM_THREADS="2"))
    assert "torch was loaded before" not in out.stderr


def test_too_late_only_when_torch_is_loaded_and_something_was_set():
    assert too_late(["GOMP_SPINCOUNT"], {}) == ""
    assert too_late([], {"torch": object()}) == ""
    assert "GOMP_SPINCOUNT" in too_late(["GOMP_SPINCOUNT"], {"torch": object()})


def _cgroup(tmp_path, v2=None, v1=None):
    if v2 is not None:
        (tmp_path / "cpu.max").write_text(v2)
    if v1 is not None:
        (tmp_path / "cpu").mkdir()
        (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text(str(v1[0]))
        (tmp_path / "cpu" / "cpu.cfs_period_us").write_text(str(v1[1]))
    return tmp_path


@pytest.mark.parametrize(
    "v2,v1,limit",
    [
        ("250000 100000\n", None, 2.5),  # cgroup v2: a pod limited to 2500m
        ("max 100000\n", None, None),
        (None, (150000, 100000), 1.5),  # cgroup v1
        (None, (-1, 100000), None),
        (None, None, None),  # no cgroup files at all
    ],
)
def test_the_cpu_limit_is_read_from_either_cgroup_version(tmp_path, v2, v1, limit):
    assert cpu_limit(_cgroup(tmp_path, v2, v1)) == limit


def test_threads_follow_the_limit_rounded_up_and_the_users_choice_wins(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    env = {}
    line = settle_threads(env, _cgroup(tmp_path, v2="250000 100000"))
    assert env == {"OMP_NUM_THREADS": "3"} and line.startswith("3 threads (64 cores")
    env = {}
    settle_threads(env, tmp_path / "nothing")
    assert env == {"OMP_NUM_THREADS": "64"}  # no limit: every core it may run on
    env = {"OMP_NUM_THREADS": "8"}
    assert "set by the user" in settle_threads(env, tmp_path)
    assert env == {"OMP_NUM_THREADS": "8"}
