"""The GPU step's Triton kernels compile for the GPUs users run, on a machine without one
(tests/triton_compile.py): Triton's interpreter, which the other GPU tests run on a CPU,
takes code that its compiler refuses. Every kernel a step launches, eagerly and from its
graph buckets, for the default target's widths and the GPU benchmark's (Llama-3.2-3B),
in bf16 (the GPU default) for H100/H200 (sm_90) and A100 (sm_80), and the tiny model's in
fp32 (`make test-cuda`'s): compiled to a cubin, within the architecture's shared memory,
and in bf16 with nothing spilled out of registers."""

import json
import os
import subprocess
import sys

from tests.triton_compile import KERNELS

SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}  # bytes a block may hold (CUDA's tables)
RUNS = [
    ("--shape", "qwen2.5-1.5b", "llama-3.2-3b", "--dtype", "bfloat16", "--arch", "90", "80"),
    ("--shape", "tiny", "--dtype", "float32", "--arch", "90"),
]


def compile_records(argv) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.triton_compile", *argv],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines()]


def test_every_kernel_of_the_step_compiles_for_the_gpus_within_their_limits(triton_ops):
    records = [r for argv in RUNS for r in compile_records(argv)]
    configs = {(r["shape"], r["dtype"], r["arch"]) for r in records}
    assert len(configs) == 5
    for config in configs:
        names = {r["kernel"] for r in records if (r["shape"], r["dtype"], r["arch"]) == config}
        assert names == KERNELS, config
    for r in records:
        assert r["shared"] <= SHARED_LIMIT[r["arch"]], r
        if r["dtype"] == "bfloat16":
            assert r["spilled"] == 0, r
