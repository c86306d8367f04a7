"""All decoder layers in one native call: the same bits as the Python loop it replaces, for
prefill chunks, decode, verification and a batch of sequences, with fused and unfused
(different bit widths) matrices and a QKV bias; and the Python loop wherever a matrix is
not quantised."""

import pytest
import torch

from specd.models import decoder_stack
from specd.models.loader import load_model
from specd.models.paged_kv import PagedKV
from specd.models.qlinear import quantize
from specd.models.seq_input import SeqInput


@pytest.fixture
def kernel(cpu_kernels):
    return cpu_kernels


def steps(model) -> list[torch.Tensor]:
    """Logits of a run of mixed steps: a prefill in two chunks, decode, a verification of
    4 rows, then two sequences in one forward."""
    kv = PagedKV.for_model(model, num_blocks=32, block_size=4)
    for s in ("a", "b"):
        kv.allocator.allocate(s)
    g = torch.Generator().manual_seed(7)
    ids = lambda n: torch.randint(3, 96, (n,), generator=g).tolist()  # noqa: E731
    return [
        model.forward(kv, [SeqInput("a", ids(9), num_logits=9)]),
        model.forward(kv, [SeqInput("a", ids(6), num_logits=2)]),
        model.forward(kv, [SeqInput("a", ids(1))]),
        model.forward(kv, [SeqInput("a", ids(4), num_logits=4)]),
        model.forward(kv, [SeqInput("b", ids(5), num_logits=1), SeqInput("a", ids(3), 3)]),
    ]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("split_qkv", [False, True])
def test_the_native_stack_gives_the_python_loops_bits(kernel, tiny, dtype, split_qkv):
    folder, _ = tiny
    model = load_model(folder, dtype=dtype, device="cpu", weights="int4")
    if split_qkv:  # as a Q4_K_M file's layers with a Q6_K v: parts of different widths
        a = model.args
        for layer in model.layers:
            w = layer.wqkv.dequantize()
            q, k, v = w.split([a.num_heads * a.head_dim, *[a.num_kv_heads * a.head_dim] * 2])
            layer.wqkv = [quantize(q, 4), quantize(k, 4), quantize(v, 8)]
    native = steps(model)
    assert model._stack, "the steps should have run in the native stack"
    model._stack = False  # the Python loop from here on
    python = steps(model)
    for got, want in zip(native, python, strict=True):
        assert torch.equal(got, want)


def test_a_dense_matrix_keeps_the_python_loop(kernel, tiny):
    folder, _ = tiny
    model = load_model(folder, dtype="fp32", device="cpu", weights="int4")
    assert decoder_stack.build(model) is not None
    model.layers[1].w_down = model.layers[1].w_down.dequantize()
    assert decoder_stack.build(model) is None
    dense = load_model(folder, dtype="fp32", device="cpu", weights="bf16")
    assert decoder_stack.build(dense) is None
