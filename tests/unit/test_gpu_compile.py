"""The GPU step's Triton kernels compile for the GPUs users run, on a machine without one
(tests/triton_compile.py): Triton's interpreter, which the other GPU tests run on a CPU,
takes code that its compiler refuses. Every kernel a step launches, eagerly and from its
graph buckets, with GEMMs of fixed tiles (a verifier's) and of a step's own rows (a
drafter's), for the configurations of tests/triton_compile.py's DEFAULT: compiled to a
cubin, within the architecture's shared memory, and in bf16 with nothing spilled out of
registers."""

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.triton_compile import DEFAULT, KERNELS

SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}  # bytes a block may hold (CUDA's tables)


def compile_records() -> list[dict]:
    """tests/triton_compile.py's default configurations, compiled in a process of their
    own (this one interprets the kernels: tests/conftest.py)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.triton_compile"],
        env=env, cwd=Path(__file__).parents[2], capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "FP_FUSION" not in done.stderr  # Triton's warning: a launch left it to a default
    return [json.loads(line) for line in done.stdout.splitlines()]


def test_every_kernel_of_the_step_compiles_for_the_gpus_within_their_limits(triton_ops):
    records = compile_records()
    compiled: dict[str, set[str]] = {}  # configuration -> the kernels compiled for it
    for r in records:
        compiled.setdefault(f"{r['shape']}/{r['dtype']}/{r['arch']}", set()).add(r["kernel"])
    assert compiled == dict.fromkeys(DEFAULT, KERNELS)
    for r in records:
        assert r["shared"] <= SHARED_LIMIT[r["arch"]], r
        if r["dtype"] == "bfloat16":
            assert r["spilled"] == 0, r
