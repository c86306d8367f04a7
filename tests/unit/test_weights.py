"""Models in int8/int4: close to their dense logits, converted once and cached, a trimmed
quantised head exact, and greedy output identical with and without speculation."""

import pytest
import torch

from specd.config import EngineConfig
from specd.models import weights
from specd.models.loader import load_model
from specd.models.paged_kv import PagedKV
from specd.models.seq_input import SeqInput
from tests.conftest import make_tiny_pair, run_engine
from tests.unit.test_drafter_cuts import PROMPT, prefill_logits
from verifier_service.engine import Engine

pytestmark = pytest.mark.usefixtures("cpu_kernels")  # fails, not skips, in CI


@pytest.fixture(scope="module")
def pair_folders(tmp_path_factory):
    """Their own copy of the tiny pair's folders: these tests write weight caches there."""
    return make_tiny_pair(tmp_path_factory, prefix="q")


# tiny random weights are harsh on int4: the worst row's cosine moves between 0.88 and 0.96
# with the seed, for qwen2 and qwen3 alike
@pytest.mark.parametrize("fmt,min_cos", [("int8", 0.998), ("int4", 0.85)])
def test_quantised_logits_track_the_dense_ones(tiny, fmt, min_cos):
    folder, _ = tiny
    dense = prefill_logits(load_model(folder, dtype="fp32", device="cpu"), PROMPT)
    model = load_model(folder, dtype="fp32", device="cpu", weights=fmt)
    assert model.weights == fmt
    approx = prefill_logits(model, PROMPT, one_by_one_from=6)
    cos = torch.nn.functional.cosine_similarity(approx, dense, dim=-1)
    assert cos.min() > min_cos


def test_converted_once_then_read_from_the_cache(pair_folders, monkeypatch):
    folder, _ = pair_folders
    first = load_model(folder, dtype="fp32", device="cpu", weights="int4")
    assert (folder / "weights-int4.safetensors").exists()

    def no_conversion(*a, **k):
        raise AssertionError("a restart must not convert again")

    monkeypatch.setattr(weights, "quantize", no_conversion)
    again = load_model(folder, dtype="fp32", device="cpu", weights="int4")
    assert torch.equal(prefill_logits(first, PROMPT), prefill_logits(again, PROMPT))


def test_a_cache_from_an_older_conversion_is_converted_again(pair_folders, monkeypatch):
    folder, _ = pair_folders
    load_model(folder, dtype="fp32", device="cpu", weights="int8")
    cache = folder / "weights-int8.safetensors"
    written = cache.stat().st_mtime_ns
    monkeypatch.setattr(weights, "CONVERSION", weights.CONVERSION + 1)
    load_model(folder, dtype="fp32", device="cpu", weights="int8")
    assert cache.stat().st_mtime_ns != written  # converted again
    assert weights._read(cache)[2] == weights.CONVERSION  # stamped with the new conversion


def test_trimmed_quantised_head_is_exact(pair_folders):
    folder, _ = pair_folders
    model = load_model(folder, dtype="fp32", device="cpu", weights="int4")
    full = prefill_logits(model, PROMPT)
    keep = torch.arange(0, 96, 2)
    model.trim_head(keep)
    assert torch.equal(prefill_logits(model, PROMPT), full[:, keep])


@pytest.mark.parametrize("fmt,head_bits", [("int4", 4), ("int8", 8)])
def test_drafter_head_is_trimmed_at_its_format_width(pair_folders, monkeypatch, fmt, head_bits):
    """int4: the kept rows are quantised again at 4 bits (the dense source's head is 8),
    close to the exact rows; int8 keeps their codes as they are."""
    from drafter_service import draft_model
    from specd.models import huge_pages, vocab

    _, draft_dir = pair_folders
    keep = list(range(0, 96, 2))
    monkeypatch.setattr(vocab, "load_or_build", lambda folder, size, vocab_size: keep[:size])
    whole = load_model(draft_dir, dtype="fp32", device="cpu", weights=fmt)
    assert whole.lm_head.bits == 8
    want = prefill_logits(whole, PROMPT)[:, keep]
    placed = []  # the weights go to their pages once, the cuts made before
    real_place = huge_pages.place_model
    monkeypatch.setattr(
        huge_pages, "place_model", lambda m: placed.append(m.lm_head.shape) or real_place(m)
    )
    model = draft_model.load_draft_model(draft_dir, "fp32", "cpu", weights=fmt, vocab=len(keep))
    assert model.lm_head.bits == head_bits and model.head_ids.tolist() == keep
    assert placed == [(len(keep), model.args.hidden_size)]
    got = prefill_logits(model, PROMPT)
    if head_bits == 8:
        assert torch.equal(got, want)
    else:
        assert not torch.equal(got, want)
        assert torch.nn.functional.cosine_similarity(got, want, dim=-1).min() > 0.97


def test_drafter_layers_wider_than_4_bits_are_quantised_again_at_4(pair_folders):
    """As a Q4_K_M GGUF leaves them: a down projection in 6 bits, a value projection in 8
    beside 4-bit q and k. four_bit_layers takes them to 4 bits, fuses q/k/v into one
    matrix again, drops the native stack, and the logits stay close."""
    from specd.models.draft_cuts import four_bit_layers
    from specd.models.qlinear import QWeight, quantize

    _, draft_dir = pair_folders
    model = load_model(draft_dir, dtype="fp32", device="cpu", weights="int4")
    layer = model.layers[0]
    dense = layer.wqkv.dequantize(torch.float32)
    n_q = model.args.num_heads * model.args.head_dim
    n_kv = model.args.num_kv_heads * model.args.head_dim
    q, k, v = dense.split([n_q, n_kv, n_kv])
    layer.wqkv = [quantize(q, 4), quantize(k, 4), quantize(v, 8)]
    layer.w_down = quantize(layer.w_down.dequantize(torch.float32), 6)
    model._stack = None
    wide = prefill_logits(model, PROMPT)
    assert model._stack  # built by the forward

    changed = four_bit_layers(model)
    assert changed == [layer.wqkv, layer.w_down] and model._stack is None
    for w in (layer.wqkv, layer.w_down):
        assert isinstance(w, QWeight) and w.bits == 4
    assert layer.wqkv.shape == (n_q + 2 * n_kv, model.args.hidden_size)
    narrow = prefill_logits(model, PROMPT)
    assert not torch.equal(narrow, wide)
    assert torch.nn.functional.cosine_similarity(narrow, wide, dim=-1).min() > 0.99
    assert four_bit_layers(model) == []  # nothing left to narrow


def test_unknown_format_is_refused():
    with pytest.raises(ValueError, match="weights must be one of"):
        weights.choose("int3", torch.device("cpu"))


class LogitsByContext:
    """While open, records every logits row `model.forward` returns (chains only), keyed by
    its sequence's tokens up to and including the row's: the same key in two runs is the
    same token in the same context, whichever forward computed it."""

    def __init__(self, model):
        self.model, self.rows, self.fed = model, {}, {}

    def __enter__(self):
        forward = self.model.forward

        def recording(kv, seqs):
            starts = [kv.allocator.length(s.seq_id) for s in seqs]
            logits, row = forward(kv, seqs), 0
            for seq, start in zip(seqs, starts, strict=True):
                fed = self.fed.setdefault(seq.seq_id, [])
                del fed[start:]  # what was cut (rejected drafts) is fed again
                fed.extend(seq.tokens)
                for i in range(len(seq.tokens) - seq.num_logits, len(seq.tokens)):
                    self.rows[tuple(fed[: start + i + 1])] = logits[row]
                    row += 1
            return logits

        self.model.forward = recording
        return self

    def __exit__(self, *exc):
        del self.model.forward  # the class's method again


# the activations (and K/V cache) each CPU class defaults to: bf16 where it has AVX512-BF16
# or AMX; fp32 with an fp16 cache on an AVX2-only CPU (specd.models.args, paged_kv)
DEFAULTS = [("bf16", torch.bfloat16), ("fp32", torch.float16)]


def chunked_logits(model, ids: list[int], chunk: int) -> torch.Tensor:
    """Logits at every position, the context fed `chunk` tokens per forward (1: decode
    steps; k + 1: verifications)."""
    kv = PagedKV.for_model(model, num_blocks=64, block_size=4)
    kv.allocator.allocate(0)
    rows = [
        model.forward(kv, [SeqInput(0, ids[i : i + chunk], num_logits=len(ids[i : i + chunk]))])
        for i in range(0, len(ids), chunk)
    ]
    return torch.cat(rows)


@pytest.mark.parametrize("dtype,kv_dtype", DEFAULTS, ids=["bf16", "fp32-fp16kv"])
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_token_rounds_the_same_decoded_alone_and_verified(pair_folders, fmt, dtype, kv_dtype):
    """The property greedy parity rests on, bit for bit: a token's logits do not depend on
    how many rows its forward held (decode, a verification of k + 1, a prefill chunk)."""
    model = load_model(pair_folders[0], dtype=dtype, device="cpu", weights=fmt)
    assert model.kv_dtype == kv_dtype and model.chunk_invariant()
    ids = PROMPT + [60, 61, 62, 63, 64, 65, 66, 67, 68, 69]
    alone = chunked_logits(model, ids, 1)
    for chunk in (3, 5, len(ids)):
        assert torch.equal(chunked_logits(model, ids, chunk), alone), chunk


@pytest.mark.parametrize("dtype,kv_dtype", DEFAULTS, ids=["bf16", "fp32-fp16kv"])
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_greedy_identical_with_and_without_speculation(pair_folders, fmt, dtype, kv_dtype):
    """Each default configuration: the quantised linear and the paged attention round a
    row the same in a 1-token decode and a (k+1)-token verification."""
    greedy_parity(pair_folders, fmt, dtype, kv_dtype)


@pytest.mark.parametrize("dtype,kv_dtype", DEFAULTS, ids=["bf16", "fp32-fp16kv"])
def test_a_qwen3_pair_is_greedy_identical_with_and_without_speculation(
    tmp_path_factory, dtype, kv_dtype
):
    """Qwen3's query and key norms, in the native layer stack, at int4."""
    greedy_parity(make_tiny_pair(tmp_path_factory, "q3", kind="qwen3"), "int4", dtype, kv_dtype)


def greedy_parity(folders, fmt: str, dtype: str, kv_dtype) -> None:
    from drafter_service.draft_model import DraftModelProposer

    target_dir, draft_dir = folders
    target = load_model(target_dir, dtype=dtype, device="cpu", weights=fmt)
    draft = load_model(draft_dir, dtype=dtype, device="cpu", weights=fmt)
    assert target.kv_dtype == kv_dtype and target.weights == fmt
    prompts = [PROMPT, PROMPT[4:], [7, 3, 9, 11, 60, 61, 62, 5], list(range(10, 40))]
    reqs = [dict(prompt=p, max_new_tokens=40) for p in prompts]
    cfg = EngineConfig(num_blocks=256, block_size=4)
    with LogitsByContext(target) as plain:
        off = run_engine(Engine(target, cfg), reqs)
    engine = Engine(target, cfg, DraftModelProposer(draft, num_blocks=256, block_size=4))
    with LogitsByContext(target) as verified:
        on = run_engine(engine, [dict(r, num_draft=4) for r in reqs])
    assert list(on.values()) == list(off.values())
    assert engine.totals.accepted > 0 and target._stack  # its layers ran in the native stack
    # and the logits behind each token, bit for bit: a tiny model's wide logit gaps hide a
    # rounding difference from the argmax that a real model's near-ties would not
    both = plain.rows.keys() & verified.rows.keys()
    assert len(both) >= sum(map(len, off.values()))
    assert all(torch.equal(plain.rows[c], verified.rows[c]) for c in both)


def test_the_cache_holds_fused_matrices_and_an_older_file_is_rewritten(pair_folders, monkeypatch):
    """q/k/v and gate/up are fused in the file, so a model maps them from it instead of
    copying them (and keeping the parts' pages resident beside the copy)."""
    from safetensors import safe_open

    folder, _ = pair_folders
    cache = folder / "weights-int8.safetensors"
    cache.unlink(missing_ok=True)
    with monkeypatch.context() as m:  # the layout written before the fused one
        m.setattr(weights, "fuse_layers", lambda mats: mats)
        m.setattr(weights, "_LAYOUT", "parts")
        old = load_model(folder, dtype="fp32", device="cpu", weights="int8")
    with safe_open(cache, framework="pt") as f:
        assert "layers.0.self_attn.q_proj.weight" in f.keys()
        assert f.metadata()["layout"] == "parts"

    new = load_model(folder, dtype="fp32", device="cpu", weights="int8")  # rewrites it
    with safe_open(cache, framework="pt") as f:
        names = set(f.keys())
        assert f.metadata()["layout"] == "fused"
    for i in range(new.args.num_layers):
        assert {
            f"layers.{i}.self_attn.qkv_proj.weight",
            f"layers.{i}.mlp.gate_up_proj.weight",
        } <= names
        assert not any(n.startswith(f"layers.{i}.") and "q_proj" in n for n in names)
    again = load_model(folder, dtype="fp32", device="cpu", weights="int8")  # reads it as is
    assert torch.equal(prefill_logits(old, PROMPT), prefill_logits(new, PROMPT))
    assert torch.equal(prefill_logits(new, PROMPT), prefill_logits(again, PROMPT))
