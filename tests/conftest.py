"""Tiny random Llama-family models built in-test, and the real models from the cache."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from specd.openmp import usable_cores

# `make test` runs the in-process tests (tests/unit, tests/real) in a pytest-xdist worker a
# core (-n auto): one torch thread each there; two where tests run one at a time in one
# process (the services' tests)
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, usable_cores()))


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: a run without it loads this too
def pytest_xdist_auto_num_workers(config):
    """-n auto: a worker a core this process may use (a container's CPU limit, not the
    node's cores)."""
    return usable_cores()


# the GPU step's Triton kernels (specd.models.gpu) run under Triton's interpreter where
# there is no GPU: set before anything imports triton
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# where the tiny-model unit tests run: cpu here and in CI; `make test-cuda` on a GPU machine
# runs the same engine and forward tests on "cuda"
TEST_DEVICE = os.environ.get("SPECD_TEST_DEVICE", "cpu")

TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def make_tiny(kind: str, folder, seed: int = 0):
    """Save a tiny random HF model of `kind` (llama with llama3 rope scaling, qwen2 with
    QKV bias and tied embeddings, or qwen3 with its query and key norms and a head_dim of
    its own) to `folder`; return the HF model (fp32, eval)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    if kind == "llama":
        config = LlamaConfig(
            **TINY,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
        model = LlamaForCausalLM(config)
    elif kind == "qwen2":
        config = Qwen2Config(
            **TINY,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        )
        model = Qwen2ForCausalLM(config)
    elif kind == "qwen3":  # per-head query and key norms; head_dim apart from hidden / heads
        from transformers import Qwen3Config, Qwen3ForCausalLM

        config = Qwen3Config(
            **TINY,
            head_dim=TINY["hidden_size"] // TINY["num_attention_heads"] * 2,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        )
        model = Qwen3ForCausalLM(config)
    else:
        raise ValueError(kind)
    with torch.no_grad():  # larger than the init's 0.02 so logits are far from uniform
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.15)
            elif "q_norm" in name or "k_norm" in name:  # not the init's ones: a test sees them
                p.uniform_(0.5, 1.5)
    model.eval()
    model.save_pretrained(folder)
    return model


@pytest.fixture
def gguf_opens(monkeypatch):
    """Every `gguf.GGUFReader` (or subclass) the test opens, counted: -> (the paths
    opened, a function that opens a file uncounted)."""
    import gguf

    opened, init = [], gguf.GGUFReader.__init__

    def counted(self, path, *args, **kwargs):
        opened.append(path)
        init(self, path, *args, **kwargs)

    def uncounted(path):
        reader = object.__new__(gguf.GGUFReader)
        init(reader, path)
        return reader

    monkeypatch.setattr(gguf.GGUFReader, "__init__", counted)
    return opened, uncounted


@pytest.fixture(scope="session", params=["llama", "qwen2", "qwen3"])
def tiny(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"tiny-{request.param}")
    hf = make_tiny(request.param, folder)
    return folder, hf


@pytest.fixture(scope="session")
def cpu_kernels():
    """The CPU kernels (int8/int4 linear, paged attention; AVX512-VNNI or AVX2); skips where this
    CPU cannot run them, fails in CI where it can but they did not build."""
    from specd.models import native

    k = native.kernel()
    if k is None:
        if os.environ.get("CI") and native.cpu_isa():
            pytest.fail(f"the CPU kernels did not build on a CPU that has {native.cpu_isa()}")
        pytest.skip("no AVX512-VNNI or AVX2 on this CPU")
    return k


@pytest.fixture(scope="session")
def triton_ops():
    """specd.models.gpu's kernels (on a CPU: under Triton's interpreter); skips where Triton
    is not installed, fails in CI, which installs it (`make setup`, the dev extras)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail("Triton is not installed: the GPU step's kernels go untested")
        pytest.skip("Triton is not installed")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        _interpret_without_overflow_checks()
        _interpret_device_calls_without_patching_again()
    from specd.models.gpu import triton_attention, triton_layer_ops

    return triton_attention, triton_layer_ops


def _interpret_without_overflow_checks() -> None:
    """Triton's interpreter checks every int32 add, subtract and multiply for overflow by
    doing it again in int64 (a third of its time on these tests); at the tests' shapes no
    int32 index comes near 2^31, and the kernels' K/V slots, the indices that grow with the
    pool, are int64 (specd.models.gpu.step_inputs). A compiled kernel checks nothing."""
    import dataclasses

    try:  # Triton's internals: where they differ, the interpreter keeps its checks
        from triton.runtime.interpreter import interpreter_builder as builder
    except ImportError:
        return
    options = getattr(builder, "options", None)
    if dataclasses.is_dataclass(options) and hasattr(options, "sanitize_overflow"):
        builder.options = dataclasses.replace(options, sanitize_overflow=False)


def _interpret_device_calls_without_patching_again() -> None:
    """Triton's interpreter points the language's builtins at its own at each launch and
    at each call of a `@triton.jit` function inside it (`_patch_lang`: `inspect.getmembers`
    over `triton.language`, ~1 ms), `tl.sum` and `tl.max` included, though after the first
    they already point there (nearly a third of its time on these tests). Within a launch, a
    function whose language modules were patched earlier in it runs without; the first
    call for each module patches as before."""
    try:  # Triton's internals: where they differ, the interpreter keeps its own way
        import triton.language as tl
        from triton.runtime import interpreter

        patch, launch = interpreter._patch_lang, interpreter.GridExecutor.__call__
        empty_scope = interpreter._LangPatchScope
    except (ImportError, AttributeError):
        return
    launches = []  # per launch in progress: the language modules patched so far in it

    def patch_once(fn, *args, **kwargs):
        modules = {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}
        if launches and modules and modules <= launches[-1]:
            return empty_scope()
        scope = patch(fn, *args, **kwargs)
        if launches:
            launches[-1] |= modules
        return scope

    def launch_patching_once(self, *args, **kwargs):
        launches.append(set())
        try:
            return launch(self, *args, **kwargs)
        finally:
            launches.pop()

    interpreter._patch_lang = patch_once
    interpreter.GridExecutor.__call__ = launch_patching_once


def wait_for(condition, timeout: float = 30.0, every: float = 0.02) -> None:
    """Poll `condition` until it holds; fail the test when `timeout` seconds pass first."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting"
        time.sleep(every)


@pytest.fixture
def aborts(cluster, monkeypatch):
    """Sequence ids the cluster's verifier engines were told to abort (a request cut
    short), for tests of `tests.cluster` clusters."""
    seen = []
    for engine in cluster.engines:

        def record(seq_id, original=engine.abort):
            seen.append(seq_id)
            original(seq_id)

        monkeypatch.setattr(engine, "abort", record)
    return seen


def real_model_or_skip(name: str):
    """Real models are fetched by `make test` (`specd models fetch`); never from a hub."""
    from specd.models.catalog import is_ready, model_dir

    folder = model_dir(name)
    if not is_ready(folder):
        if os.environ.get("CI"):
            pytest.fail(f"real model {name} missing: `make models` should have fetched it")
        pytest.skip(f"{name} not in the cache; run `specd models fetch`")
    return folder


def make_tiny_pair(tmp_path_factory, prefix: str = "pair", kind: str = "llama"):
    """Folders of a tiny target (a Llama unless `kind` says) and a draft that is the target
    with noise added, so it agrees often but not always."""
    folder = tmp_path_factory.mktemp(f"{prefix}-target")
    hf = make_tiny(kind, folder, seed=3)
    draft_folder = tmp_path_factory.mktemp(f"{prefix}-draft")
    with torch.no_grad():
        g = torch.Generator().manual_seed(4)
        for name, p in hf.named_parameters():
            if "norm" not in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.06)
    hf.save_pretrained(draft_folder)
    return folder, draft_folder


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """(target, draft) tiny Llama models in fp32 on TEST_DEVICE (make_tiny_pair)."""
    from specd.models.loader import load_model

    folder, draft_folder = make_tiny_pair(tmp_path_factory)
    return load_model(folder, dtype="fp32", device=TEST_DEVICE), load_model(
        draft_folder, dtype="fp32", device=TEST_DEVICE
    )


def run_engine(engine, requests: list[dict]) -> dict[int, list[int]]:
    """Add requests, step the engine until idle; returns generated tokens per request."""
    from verifier_service.request import Request

    ids = [engine.add_request(Request(**r)) for r in requests]
    out = {i: [] for i in ids}
    reasons = {}
    for _ in range(10_000):
        if not engine.has_work():
            break
        for o in engine.step():
            out[o.seq_id].extend(o.tokens)
            if o.finish_reason:
                reasons[o.seq_id] = o.finish_reason
    assert set(reasons) == set(ids), "every request must finish"
    return {i: out[i] for i in ids}


def run_engine_logprobs(engine, requests: list[dict]) -> list[tuple[list[int], list]]:
    """As run_engine, for requests that ask for logprobs: each one's tokens and their
    TokenLogprobs (one per token, checked as they arrive), in the requests' order."""
    from verifier_service.request import Request

    ids = [engine.add_request(Request(**r)) for r in requests]
    tokens, logprobs = {i: [] for i in ids}, {i: [] for i in ids}
    while engine.has_work():
        for o in engine.step():
            assert len(o.logprobs) == len(o.tokens)
            tokens[o.seq_id] += o.tokens
            logprobs[o.seq_id] += o.logprobs
    return [(tokens[i], logprobs[i]) for i in ids]


def said_logs(stdout: str) -> list[Path]:
    """The folders a bench said it kept its services' logs in ("service logs: DIR")."""
    return [Path(line.split(": ", 1)[1]) for line in stdout.splitlines() if "service logs" in line]


def run_specd(args: list[str], timeout: float, tmp: Path) -> subprocess.CompletedProcess:
    """`python -m launcher *args` in a process group of its own, killed whole at the end:
    a run past `timeout` fails the test without leaving the services it started behind.
    Its temporary folders (the services' logs a bench keeps) go under `tmp`, the test's
    own, which pytest clears: never one more in /tmp a run."""
    cmd = [sys.executable, "-m", "launcher", *args]
    env = {**os.environ, "TMPDIR": str(tmp)}
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=env,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        what = " ".join(args[:2])
        pytest.fail(f"`specd {what}` ran past {timeout} s:\n{out[-2000:]}{err[-3000:]}")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
