"""libgomp's spin count for the model services (specd/openmp.py): set before torch loads,
never over the user's own choice."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from specd.openmp import SPIN_COUNT, settle_spinning


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
            seen.append((os.environ.get("GOMP_SPINCOUNT"), "torch" in sys.modules))

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
def test_serve_sets_the_spin_count_before_torch_loads(argv, spin, monkeypatch):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    out = subprocess.run(
        [sys.executable, "-c", _SERVE, *argv], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == repr([(spin, False)])
