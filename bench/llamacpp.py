"""llama.cpp's server as the peer of `specd bench sweep --peer llamacpp`.

Build it once with `make peer-llamacpp` (bench/peer/build_llamacpp.sh: llama.cpp from the
llama-cpp-python sdist). The same GGUF files, the same conversations through its OpenAI
chat endpoint (greedy, same max tokens), on loopback, 2 threads; tokens/s is counted as
the specd cells count it (completion tokens over the cell's wall time). Variants: plain,
with the draft model (`-md`, k = 3 as llama.cpp's default), and n-gram lookup drafting.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.prompts import WARM_UP_TOKENS
from launcher.processes import free_port
from specd.models.catalog import ALIASES, CATALOG, cache_root

VARIANTS = {
    "llamacpp": [],
    # flag names of the llama.cpp that llama-cpp-python 0.3.36 vendors
    "llamacpp-draft": ["--spec-type", "draft-simple", "--spec-draft-n-max", "3"],  # + "-md"
    "llamacpp-ngram": ["--spec-type", "ngram-simple", "--spec-draft-n-max", "8"],
}
EXIT_WAIT_S = 30  # after SIGTERM, before a llama-server is killed


def binary(name: str) -> Path:
    path = cache_root() / "peer" / "llama.cpp" / "build" / "bin" / name
    if not path.exists():
        raise SystemExit(f"{path} missing: build it with `make peer-llamacpp`")
    return path


def gguf_path(model: str) -> Path:
    name = ALIASES.get(model, model)
    if name in CATALOG:
        return cache_root() / "gguf" / CATALOG[name].gguf_name
    return Path(model)


def _wait_ready(port: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError("llama-server did not become ready")


def chat(port: int, messages, max_new: int, **extra) -> dict:
    """One greedy chat completion (`extra`: more body fields, e.g. response_format), or
    a raw prompt's completion where `messages` is its text."""
    given, path = {"messages": messages}, "chat/completions"
    if isinstance(messages, str):
        given, path = {"prompt": messages}, "completions"
    body = {**given, "max_tokens": max_new, "temperature": 0.0, "seed": 0, **extra}
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def _tokens(port: int, messages, max_new: int) -> int:
    return chat(port, messages, max_new)["usage"]["completion_tokens"]


@contextlib.contextmanager
def server(name: str, model: str, draft_model: str, slots: int, log_dir):
    """A llama-server variant on a free loopback port, ready and warmed up: yields it."""
    port = free_port()
    cmd = [str(binary("llama-server")), "-m", str(gguf_path(model)), "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "-t", str(os.cpu_count() or 2), "-np", str(slots)]
    cmd += ["-c", str(slots * 2048), "--no-webui", *VARIANTS[name]]
    if name == "llamacpp-draft":
        cmd += ["-md", str(gguf_path(draft_model))]
    log = open(Path(log_dir) / f"{name}.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_ready(port, proc)
        chat(port, [{"role": "user", "content": "hi"}], 8)  # warm-up
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=EXIT_WAIT_S)
        except subprocess.TimeoutExpired:  # a llama-server may hang on its way out
            proc.kill()
            proc.wait()
        log.close()


def run_variant(name, model, draft_model, conversations, levels, requests, max_new, log_dir):

    cells = []
    with server(name, model, draft_model, max(levels), log_dir) as port:
        for messages in conversations:  # untimed: its prompt cache warm, as specd's
            chat(port, messages, WARM_UP_TOKENS)
        for c in levels:
            jobs = [conversations[i % len(conversations)] for i in range(requests)]
            start = time.perf_counter()
            with ThreadPoolExecutor(c) as pool:
                tokens = sum(pool.map(lambda m: _tokens(port, m, max_new), jobs))
            wall = time.perf_counter() - start
            cells.append({"concurrency": c, "tokens": tokens, "tokens_per_s": tokens / wall})
    return cells


def llamacpp_peer(model, draft_model, conversations, levels, requests, max_new, log_dir, names):
    out = {}
    for name in names:
        try:
            out[name] = run_variant(
                name, model, draft_model, conversations, levels, requests, max_new, log_dir
            )
        except (RuntimeError, TimeoutError) as e:  # a variant this build lacks
            out[name] = {"error": str(e)}
    return out
