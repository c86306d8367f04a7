"""GGUF blocks into the quantised format: the codes are kept (checked against the `gguf`
package's own dequantiser on random blocks), names map as transformers maps them, and
llama.cpp's q/k row order is undone exactly."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from specd.models import gguf_blocks as gb


def random_blocks(kind: str, rows: int, cols: int, seed: int = 0):
    """A GGUF-reader-like tensor of random blocks with sane fp16 scales."""
    rng = np.random.default_rng(seed)
    size = {"Q4_K": 144, "Q4_1": 20}[kind]
    per_row = cols // (256 if kind == "Q4_K" else 32)
    raw = rng.integers(0, 256, (rows * per_row, size), dtype=np.uint8)
    scales = rng.uniform(1e-3, 5e-2, (rows * per_row, 2)).astype(np.float16)
    raw[:, :4] = scales.view(np.uint8)  # d and dmin (Q4_K), d and m (Q4_1)
    return SimpleNamespace(
        tensor_type=GGMLQuantizationType[kind],
        shape=np.array([cols, rows]),  # GGUF order: inner first
        data=raw.reshape(rows, per_row * size),
    )


def test_q4_k_blocks_are_kept_as_they_are():
    t = random_blocks("Q4_K", rows=32, cols=512)
    w = gb.to_qweight(t, "int4")
    assert w.bits == 4
    ref = torch.from_numpy(quants.dequantize(t.data, t.tensor_type)).reshape(32, 512)
    # codes, fp16 d and dmin, 6-bit scales and mins: the same weights, bit for bit
    assert torch.equal(w.dequantize(), ref)


def test_q4_1_blocks_are_quantised_again_at_four_bits():
    # Q4_1's fp16 scale per 32 has no two-level form: requantised from its dense values
    t = random_blocks("Q4_1", rows=32, cols=512)
    w = gb.to_qweight(t, "int4")
    ref = torch.from_numpy(quants.dequantize(t.data, t.tensor_type)).reshape(32, 512)
    assert w.bits == 4 and (w.dequantize() - ref).abs().max() <= 0.1 * ref.abs().max()


def test_int8_mode_requantises_at_eight_bits():
    t = random_blocks("Q4_K", rows=16, cols=256)
    w = gb.to_qweight(t, "int8")
    ref = torch.from_numpy(quants.dequantize(t.data, t.tensor_type)).reshape(16, 256)
    assert w.bits == 8 and (w.dequantize() - ref).abs().max() <= 0.01 * ref.abs().max()


@pytest.mark.parametrize("name", ["output.weight", "blk.0.ffn_down.weight"])
def test_q6_k_blocks_keep_their_codes_in_int4_mode(name):
    # llama.cpp's Q4_K_M keeps the LM head and half the down projections in Q6_K
    rng = np.random.default_rng(3)
    raw = rng.integers(0, 256, (16, 2 * 210), dtype=np.uint8)  # 16 rows of two 256-blocks
    for b in range(2):  # d of each block
        d = rng.uniform(1e-4, 1e-3, (16, 1)).astype(np.float16).view(np.uint8)
        raw[:, 210 * b + 208 : 210 * b + 210] = d
    t = SimpleNamespace(
        name=name, tensor_type=GGMLQuantizationType.Q6_K, shape=np.array([512, 16]), data=raw
    )
    ref = torch.from_numpy(quants.dequantize(t.data, t.tensor_type)).reshape(16, 512)
    w = gb.to_qweight(t, "int4")
    assert w.bits == 6
    # the codes, fp16 d and int8 scales as they are: the same weights, bit for bit
    d = torch.from_numpy(raw.reshape(16, 2, 210)[..., 208:].copy().view(np.float16)).float()
    sc = torch.from_numpy(raw.reshape(16, 2, 210)[..., 192:208].copy().view(np.int8)).float()
    assert torch.equal(w.group_params()[0], (d * sc).reshape(16, 32))
    assert torch.equal(w.dequantize(), ref)
    assert gb.to_qweight(t, "int8").bits == 8


def test_names_map_like_transformers():
    assert gb.hf_name("blk.3.ffn_up.weight") == "layers.3.mlp.up_proj.weight"
    assert gb.hf_name("blk.0.attn_output.weight") == "layers.0.self_attn.o_proj.weight"
    assert gb.hf_name("output.weight") == "lm_head.weight"
    assert gb.hf_name("token_embd.weight") == "embed_tokens.weight"
    assert gb.hf_name("blk.0.attn_norm.weight") is None  # norms stay dense


def test_unpermute_rows_is_transformers_reverse_permute():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    t = random_blocks("Q4_K", rows=64, cols=256, seed=5)
    w = gb.to_qweight(t, "int4")
    proc = LlamaTensorProcessor(config={"num_attention_heads": 4, "num_key_value_heads": 4})
    expect = proc._reverse_permute_weights(w.dequantize().numpy(), 4, 4)
    assert torch.equal(gb.unpermute_rows(w, 4).dequantize(), torch.from_numpy(expect))


def write_gguf(path, seed: int = 0):
    """A small GGUF: a vocabulary array, a Q4_K matrix, a Q4_1 matrix and an F32 vector."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_token_list([f"token{i}" for i in range(500)])
    for name, kind in (("blk.0.ffn_up.weight", "Q4_K"), ("blk.0.ffn_down.weight", "Q4_1")):
        t = random_blocks(kind, rows=16, cols=512, seed=seed)
        w.add_tensor(name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    w.add_tensor("output_norm.weight", np.arange(512, dtype=np.float32) + seed)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_ggufs_tensors_are_read_through_its_table_as_the_reader_reads_them(tmp_path, gguf_opens):
    path, table = tmp_path / "m.gguf", tmp_path / gb.TABLE
    write_gguf(path)
    opened, open_file = gguf_opens
    for _ in range(2):  # the first read writes the table, the second reads through it
        arch, tensors = gb.tensors_of(path, table)
        assert arch == "llama" and len(opened) == 1
        reader = open_file(str(path))
        assert [t.name for t in tensors] == [t.name for t in reader.tensors]
        for ours, theirs in zip(tensors, reader.tensors, strict=True):
            assert ours.tensor_type == theirs.tensor_type
            assert list(ours.shape) == theirs.shape.tolist()
            assert np.array_equal(ours.data, theirs.data.reshape(-1).view(np.uint8))
    write_gguf(path, seed=1)  # a new file at the same path: read again, not through the table
    _, tensors = gb.tensors_of(path, table)
    assert len(opened) == 2 and tensors[-1].data.view(np.float32)[0] == 1


def test_the_plain_array_reader_reads_what_the_gguf_package_reads(tmp_path):
    """open_gguf: every metadata field (its parts, types and value indices) and every
    tensor (type, shape, offset, bytes) as `gguf.GGUFReader` parses them from the map."""
    import gguf

    path = tmp_path / "m.gguf"
    write_gguf(path)
    ours, theirs = gb.open_gguf(path), gguf.GGUFReader(str(path))
    assert type(ours.data) is np.ndarray and isinstance(theirs.data, np.memmap)
    assert list(ours.fields) == list(theirs.fields) and "tokenizer.ggml.tokens" in ours.fields
    for name, field in ours.fields.items():
        other = theirs.fields[name]
        assert (field.offset, field.types, field.data) == (other.offset, other.types, other.data)
        assert len(field.parts) == len(other.parts)
        assert all(np.array_equal(a, b) for a, b in zip(field.parts, other.parts, strict=True))
    assert len(ours.tensors) == len(theirs.tensors) == 3
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.name, a.tensor_type, a.data_offset) == (b.name, b.tensor_type, b.data_offset)
        assert np.array_equal(a.shape, b.shape) and np.array_equal(a.data, b.data)
