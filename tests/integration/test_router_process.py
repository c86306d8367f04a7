"""The router as its own process, as it runs beside a model server: it serves prompts and
chat through its tokenizer with no torch library mapped, in little memory."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.processes import free_port, scrape
from router.client import SpecdClient
from tests.cluster import save_tiny_cluster_model
from tests.integration.test_faults import router, verifier

pytestmark = pytest.mark.timeout(300)

MAX_RSS = 150 << 20


def mapped_libraries(pid: int) -> set[str]:
    paths = {line.split()[-1] for line in Path(f"/proc/{pid}/maps").read_text().splitlines()}
    return {p for p in paths if p.endswith(".so") or ".so." in p}


def test_a_serving_router_maps_no_torch_and_stays_small(tmp_path):
    model = save_tiny_cluster_model(tmp_path / "tiny")
    target = verifier(model, tmp_path).start()
    http = free_port()
    front = router(model, tmp_path, target, extra=("--http-port", str(http))).start()
    try:
        with SpecdClient(front.address) as client:
            chat = client.generate(messages=[{"role": "user", "content": "hi"}], max_new_tokens=8)
            raw = client.generate("abc", max_new_tokens=8, ignore_eos=True)
            streamed = list(client.stream("abc", max_new_tokens=8, ignore_eos=True))
        assert chat.usage.prompt_tokens == len("user: hi\nassistant: ")  # the template's
        assert raw.usage.completion_tokens == 8 and raw.text
        assert "".join(m.text for m in streamed) == raw.text
        # no --metrics-port: its metrics are on its HTTP port, and count what it served
        assert scrape(http, "specd:requests") == 3
        libraries = mapped_libraries(front.proc.pid)
        assert any("libpython" in x or "grpc" in x for x in libraries)  # the maps were read
        assert not [x for x in libraries if "torch" in x], "the router mapped torch"
        rss = front.rss_bytes()
        print(f"router resident memory after serving: {rss / 2**20:.0f} MiB")
        assert rss < MAX_RSS
    finally:
        for p in (front, target):
            p.stop()


def test_absent_sampling_fields_take_the_models_recommended_values(tmp_path):
    """A model folder whose generation_config.json recommends temperature 0: an HTTP
    request that names no temperature is greedy, whatever its seed, as one that names 0;
    one that names 1 samples (two seeds, two answers). The router read the folder itself."""
    import json
    import urllib.request

    model = save_tiny_cluster_model(tmp_path / "tiny")
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps(config | {"temperature": 0.0}))
    target = verifier(model, tmp_path).start()
    http = free_port()
    front = router(model, tmp_path, target, extra=("--http-port", str(http))).start()

    def complete(**fields) -> str:
        body = {"model": str(model), "prompt": "abc", "max_tokens": 16, "ignore_eos": True}
        req = urllib.request.Request(
            f"http://127.0.0.1:{http}/v1/completions",
            json.dumps(body | fields).encode(),
            {"content-type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=60) as reply:
            return json.load(reply)["choices"][0]["text"]

    try:
        unnamed = {complete(seed=seed) for seed in (1, 2, 3)}
        assert unnamed == {complete(temperature=0)}
        assert complete(temperature=1.0, seed=1) != complete(temperature=1.0, seed=2)
    finally:
        for p in (front, target):
            p.stop()


def test_the_servers_sampling_overrides_fill_what_a_request_leaves_out(tmp_path):
    """vLLM's --override-generation-config over the model's recommended temperature 0: an
    OpenAI request that names no temperature samples at the override's 1.0 (two seeds, two
    answers); llama-server's /completion takes the override's top_k 1 over its own 40, so
    it is greedy whatever its seed, as llama-server's --top-k 1 makes it. With
    --default-seed, an unseeded request samples as one naming it."""
    import json
    import urllib.request

    model = save_tiny_cluster_model(tmp_path / "tiny")
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps(config | {"temperature": 0.0}))
    target = verifier(model, tmp_path).start()
    http = free_port()
    overrides = json.dumps({"temperature": 1.0, "top_k": 1})
    extra = ("--http-port", str(http), "--override-generation-config", overrides)
    front = router(model, tmp_path, target, extra=(*extra, "--default-seed", "7")).start()

    def post(path: str, body: dict) -> dict:
        req = urllib.request.Request(
            f"http://127.0.0.1:{http}{path}", json.dumps(body).encode(), {}
        )
        with urllib.request.urlopen(req, timeout=60) as reply:
            return json.load(reply)

    def complete(**fields) -> str:
        body = {"model": str(model), "prompt": "abc", "max_tokens": 16, "ignore_eos": True}
        return post("/v1/completions", body | fields)["choices"][0]["text"]

    def llama(**fields) -> str:
        body = {"prompt": "abc", "n_predict": 16, "ignore_eos": True}
        return post("/completion", body | fields)["content"]

    try:
        assert complete(top_k=0, seed=1) != complete(top_k=0, seed=2)  # temperature 1.0
        assert complete(top_k=0, seed=1) == complete(top_k=0, seed=1, temperature=1.0)
        # llama-server's -s: an unseeded request samples as one naming the server's seed
        assert complete(top_k=0) == complete(top_k=0) == complete(top_k=0, seed=7)
        assert {llama(seed=seed) for seed in (1, 2, 3)} == {llama(temperature=0)}
    finally:
        for p in (front, target):
            p.stop()


def test_the_http_port_may_speak_https_with_the_grpc_port_plain(tmp_path):
    """The HTTP door's own certificate (what `specd up --ssl-certfile --ssl-keyfile`
    gives it, as vLLM's flags make its port HTTPS): HTTPS there, trusted through the
    certificate, plain HTTP refused; the gRPC port, which `specd up`'s readiness check and
    its clients on the host reach, stays plain."""
    import json
    import ssl
    import urllib.error
    import urllib.request

    from tests.integration.test_tls import self_signed

    cert, key = self_signed(tmp_path)
    model = save_tiny_cluster_model(tmp_path / "tiny")
    target = verifier(model, tmp_path).start()
    http = free_port()
    extra = ("--http-port", str(http), "--http-tls-cert", cert, "--http-tls-key", key)
    front = router(model, tmp_path, target, extra=extra).start()  # ready over plain gRPC
    body = json.dumps({"prompt": "abc", "max_tokens": 4, "ignore_eos": True}).encode()
    try:
        secure = urllib.request.Request(f"https://localhost:{http}/v1/completions", body)
        trusted = ssl.create_default_context(cafile=cert)
        with urllib.request.urlopen(secure, context=trusted, timeout=60) as reply:
            assert json.load(reply)["usage"]["completion_tokens"] == 4
        plain = urllib.request.Request(f"http://127.0.0.1:{http}/v1/completions", body)
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(plain, timeout=10)
        with SpecdClient(front.address) as client:
            assert client.generate("abc", max_new_tokens=4, ignore_eos=True).text
    finally:
        for p in (front, target):
            p.stop()
