"""The GPU step's Triton kernels compiled for a GPU on a machine that has none.

Triton's interpreter, which runs the kernels on a CPU in `make test`, accepts code that
its compiler refuses (a plain global read inside a kernel, for one). Here every launch
that `GpuStep` makes, eagerly and from its graph buckets, is compiled by Triton's own
compiler to PTX and by ptxas to a cubin for a given CUDA architecture, as it would be on
that GPU, and not run: Triton's driver is replaced by one that names the target and has
no device, and its cache hook compiles each new specialisation and skips the launch.
The model has a real model's widths (bench.gpu.shapes) and one layer, and its K/V pool
holds its whole context: the kernels' constants are those widths. The GEMMs between the
kernels only give their outputs' shapes, as nothing is computed.

    python -m tests.triton_compile [SHAPE/DTYPE/ARCH ...]

prints one JSON line per compiled kernel: its name, shape, dtype, architecture, warps,
shared memory, registers and spilled bytes (ptxas's, as cuobjdump reads them). Run it
without TRITON_INTERPRET set: under the interpreter nothing is compiled.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

KERNELS = {  # every kernel a step launches (specd.models.gpu)
    "_add_rms_norm_kernel", "_rope_store_kernel", "_split_kernel", "_combine_kernel",
    "_silu_mul_kernel",
}  # fmt: skip
# the default target's widths (QKV bias) in bf16, the GPU default, for H100 and H200
# (sm_90); the GPU benchmark's (Llama-3.2-3B: no bias, Llama 3's RoPE) for A100 (sm_80);
# the tiny test model in fp32 (`make test-cuda`'s)
DEFAULT = [
    "qwen2.5-1.5b/bfloat16/90", "llama-3.2-3b/bfloat16/80", "tiny/float32/90",
]  # fmt: skip


class CompileOnlyDriver:
    """Triton's driver for a GPU that is not here: the target to compile for, device 0,
    no stream (nothing launches: `_skip_launch` stops every launch before it)."""

    def __init__(self, target):
        self.target = target

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


def resources(cubin: bytes) -> dict[str, int]:
    """Registers and spilled bytes (local memory and stack) of a cubin's kernel."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run(
            [str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    fields = dict(re.findall(r"\b(REG|LOCAL|STACK):(\d+)", out))
    return {"registers": int(fields["REG"]), "spilled": int(fields["LOCAL"]) + int(fields["STACK"])}


def compile_step(shape: str, dtype: torch.dtype, arch: int) -> list[dict]:
    """Compile every kernel launch of a few steps of `shape`'s model (one layer) for
    sm_`arch`: a prefill chunk, a decode row, a verification beside a chunk, a tree beside
    a decode row, eagerly with GEMMs of each step's own rows (a drafter's) and of fixed
    tiles (a verifier's), and from the graph buckets -> a record per specialisation."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    from bench.gpu import shapes
    from specd.models.gpu.graphs import StepGraphs
    from specd.models.gpu.step import GpuStep
    from specd.models.gpu.step_inputs import HostRows
    from specd.models.paged_kv import PagedKV
    from specd.models.seq_input import SeqInput

    target = GPUTarget("cuda", arch, 32)
    records: dict = {}

    def _skip_launch(*, key, fn, compile, **_) -> bool:
        if key not in records:
            jit, attrs = fn.jit_function, compile["configs"][0]
            src = jit.ASTSource(jit, compile["signature"], compile["constants"], attrs)
            options = {
                name: compile[name]
                for name in ("num_warps", "num_ctas", "num_stages", "enable_fp_fusion")
            }
            kernel = triton.compile(src, target=target, options=options)
            records[key] = {
                "kernel": fn.name, "shape": shape, "dtype": str(dtype).removeprefix("torch."),
                "arch": arch, "warps": kernel.metadata.num_warps,
                "shared": kernel.metadata.shared, **resources(kernel.asm["cubin"]),
            }  # fmt: skip
        return True  # compiled: do not launch

    _, model = shapes.build(shape, "cpu", dtype, num_hidden_layers=1, vocab_size=256)
    driver.set_active(CompileOnlyDriver(target))
    knobs.runtime.jit_cache_hook = _skip_launch

    class Step(GpuStep):  # nothing launches, so the GEMMs between need not run either
        def linear(self, x, w, b=None, out=None):
            return x.new_empty(len(x), len(w))

    try:
        steps = [
            [SeqInput("a", list(range(3, 40)), num_logits=1)],
            [SeqInput("a", [7], 1)],
            [SeqInput("a", [11, 12, 13, 14, 15], 5), SeqInput("b", list(range(3, 20)), 1)],
            [SeqInput("a", [11, 12, 13, 14], 4, parents=[-1, 0, 0, 2]), SeqInput("b", [17], 1)],
        ]
        # a pool of the model's whole context, as deployed (nothing a kernel holds may grow with it)
        blocks = -(-model.args.max_position_embeddings // 16)
        kv = PagedKV.for_model(model, num_blocks=blocks)
        for tile in (0, Step(model).tile):  # a drafter's own rows; a verifier's tiles
            step = Step(model, tile=tile)
            for seq in ("a", "b"):
                kv.allocator.allocate(seq)
            for seqs in steps:
                step.forward(kv, seqs)
            for seq in ("a", "b"):
                kv.allocator.free(seq)
        kv.allocator.allocate("a")
        graphs = StepGraphs(step, kv, max_seqs=2, max_rows=8, capture=False)
        graphs.replay(HostRows.build(kv.allocator, [SeqInput("a", [5, 6], 2)]))
    finally:  # the driver stays: this process has no other (`main` runs in its own)
        knobs.runtime.jit_cache_hook = None
    return list(records.values())


def main(argv: list[str] | None = None) -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("TRITON_INTERPRET is set: the kernels would be interpreted, not compiled")
        return 2
    p = argparse.ArgumentParser(prog="python -m tests.triton_compile")
    p.add_argument(
        "configs",
        nargs="*",
        default=DEFAULT,
        help="SHAPE/DTYPE/ARCH, e.g. llama-3.2-3b/bfloat16/90 (sm_90: H100, H200)",
    )
    for config in p.parse_args(argv).configs:
        shape, dtype, arch = config.split("/")
        for record in compile_step(shape, getattr(torch, dtype), int(arch)):
            print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
