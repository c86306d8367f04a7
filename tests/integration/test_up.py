"""`specd up` as users run it: ready line, a request, clean stop on SIGTERM; a SIGKILLed
drafter or verifier is restarted while the cluster keeps serving (issue #16)."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest

from bench.faults import Up
from launcher.cli import main
from launcher.processes import free_port
from router.client import SpecdClient
from specd.channels import check_health
from tests.cluster import save_tiny_cluster_model
from tests.conftest import real_model_or_skip, wait_for


@pytest.mark.real
def test_specd_up_starts_serves_and_stops_cleanly():
    real_model_or_skip("smollm2-135m-instruct")
    ports = {role: free_port() for role in ("router", "verifier", "drafter", "http")}
    cmd = [
        sys.executable,
        "-m",
        "launcher",
        "up",
        "--target",
        "small",
        "--draft",
        "small",
        "--router-port",
        str(ports["router"]),
        "--verifier-port",
        str(ports["verifier"]),
        "--drafter-port",
        str(ports["drafter"]),
        "--http-port",
        str(ports["http"]),
        "--ready-timeout",
        "180",
        "--verifier-flags=--log-stats-interval 0.5",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        deadline = time.monotonic() + 200
        for line in proc.stdout:
            lines.append(line)
            if "specd is up" in line or time.monotonic() > deadline:
                break
        assert any("specd is up" in x for x in lines), "".join(lines[-30:])
        ready_text = "".join(lines) + proc.stdout.readline() + proc.stdout.readline()
        assert "specd generate" in ready_text  # a ready-to-paste client command
        later: list[str] = []  # what it logs from now on, read beside the test

        def read() -> None:
            for line in proc.stdout:
                later.append(line)

        threading.Thread(target=read).start()
        with SpecdClient(f"127.0.0.1:{ports['router']}") as client:
            # ready means speculating: the verifier waits for its drafter before serving
            r = client.generate(
                messages=[{"role": "user", "content": "Say hi."}],
                max_new_tokens=8,
                speculation="on",
            )
            assert r.usage.completion_tokens > 0
        assert r.speculation.enabled
        assert "curl http://" in ready_text  # and the OpenAI door, as the README shows it
        with openai.OpenAI(base_url=f"http://127.0.0.1:{ports['http']}/v1", api_key="-") as c:
            chat = c.chat.completions.create(
                model="smollm2-135m-instruct",
                messages=[{"role": "user", "content": "Say hi."}],
                max_tokens=8,
                temperature=0,
            )
        assert chat.choices[0].message.content and chat.usage.completion_tokens > 0
        # and the verifier's log says what it did, as vLLM's engine does
        said = lambda: any("Avg generation throughput" in x for x in later)  # noqa: E731
        wait_for(said, timeout=30, every=0.1)
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
    assert code == 0
    for port in ports.values():
        assert not check_health(f"127.0.0.1:{port}", timeout=0.5)


def test_specd_up_keeps_serving_through_a_killed_drafter_and_a_killed_verifier(tmp_path):
    model = save_tiny_cluster_model(tmp_path / "tiny")
    ports = {"router": free_port(), "verifier": free_port(), "drafter": free_port()}
    up = Up(
        *("--target", str(model), "--draft", str(model), "--dtype", "float32"),
        *("--router-port", str(ports["router"]), "--drafter-port", str(ports["drafter"])),
        *("--verifier-port", str(ports["verifier"]), "--verifiers", "2"),
        *("--http-port", str(free_port())),
    )
    try:
        up.wait_for("specd is up", 120)
        drafter, verifier = up.pid("drafter"), up.pid("verifier")
        with SpecdClient(f"127.0.0.1:{ports['router']}") as client, ThreadPoolExecutor(8) as pool:
            # 1. the drafter is SIGKILLed once all 8 streams are producing: none fails
            first: set[int] = set()

            def stream(i: int) -> int:
                n = 0
                for msg in client.stream(
                    f"drafter {i}", max_new_tokens=300, ignore_eos=True, speculation="on"
                ):
                    first.add(i)
                    n += len(msg.token_ids)
                return n

            futures = [pool.submit(stream, i) for i in range(8)]
            while len(first) < 8:
                assert not any(f.done() and f.exception() for f in futures)
                time.sleep(0.01)
            mark = len(up.lines)
            os.kill(drafter, signal.SIGKILL)
            assert [f.result(timeout=120) for f in futures] == [300] * 8  # 0 failures
            up.wait_for("drafter exited with -9; restart 1", 10, mark)
            assert up.pid("drafter", mark) != drafter  # back within 60 s
            deadline = time.monotonic() + 60
            while True:  # and speculating again once the verifier has reconnected
                r = client.generate("again", max_new_tokens=16, speculation="on")
                if r.speculation.drafted > 0 or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            assert r.speculation.drafted > 0, r.speculation

            # 2. one of two verifiers is SIGKILLed under 8 unary requests: each is retried
            # on the other replica (nothing had reached its client), none fails
            mark = len(up.lines)
            unary = lambda i: len(  # noqa: E731
                client.generate(f"verifier {i}", max_new_tokens=300, ignore_eos=True).token_ids
            )
            futures = [pool.submit(unary, i) for i in range(8)]
            time.sleep(0.3)
            os.kill(verifier, signal.SIGKILL)
            assert [f.result(timeout=120) for f in futures] == [300] * 8
            up.wait_for("verifier exited with -9; restart 1", 10, mark)
            up.pid("verifier", mark)
            assert "trying another" in up.text(mark), "the kill must hit requests in flight"
    finally:
        code = up.stop(60)
    assert code == 0, up.text()[-3000:]
    assert "SIGTERM: stopping every process" in up.text()
    for port in ports.values():
        assert not check_health(f"127.0.0.1:{port}", timeout=0.5)


def test_specd_up_runs_a_vllm_launch_command(tmp_path, monkeypatch, capsys):
    """A vLLM user's launch flags as `specd up` serves them: the `--speculative-config`
    (a lookup in the verifier, with no drafter process and no draft model, and the k it
    names, past the verifier's default of 8), `--port`, `--api-key` on both doors,
    `--served-model-name` (two names), `--max-model-len` and `--chat-template`; and
    llama-server's threads."""
    model = save_tiny_cluster_model(tmp_path / "tiny")
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}<{{ m['content'] }}>{% endfor %}")
    spec = '{"method": "ngram", "num_speculative_tokens": 10, "prompt_lookup_max": 2}'
    router, http, key = free_port(), free_port(), "k3y-for-the-test"
    up = Up(
        *("--target", str(model), "--dtype", "float32", "--speculative-config", spec),
        *("--router-port", str(router), "--drafter-port", str(free_port())),
        *("--verifier-port", str(free_port()), "--port", str(http), "--api-key", key),
        *("--served-model-name", "tiny-coder", "gpt-4o", "--max-model-len", "200"),
        *("--chat-template", str(template)),
        *("--trust-remote-code", "-t", "2", "-td", "1"),  # llama-server's threads
    )
    try:
        up.wait_for("specd is up", 120)
        up.wait_for(r"verifier: 2 threads \(OMP_NUM_THREADS, set by the user\)", 1)
        # vLLM's ngram method looks up in the verifier: no drafter process is started
        assert not re.search(r"drafter: \d+ threads", up.text()), up.text()[-3000:]
        with openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="wrong") as c:
            with pytest.raises(openai.AuthenticationError):
                c.models.list()
        with openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key=key) as c:
            cards = [m.model_dump() for m in c.models.list().data]
            card = cards[0]
            assert [m["id"] for m in cards] == ["tiny-coder", "gpt-4o"]  # vLLM's two names
            with pytest.raises(openai.BadRequestError, match="context"):
                c.completions.create(model="gpt-4o", prompt="a" * 10, max_tokens=195)
        chat = [{"role": "user", "content": "hi"}, {"role": "user", "content": "yo"}]
        asked = urllib.request.Request(
            f"http://127.0.0.1:{http}/apply-template",  # llama-server's: the prompt rendered
            data=json.dumps({"messages": chat}).encode(),
            headers={"authorization": f"Bearer {key}", "content-type": "application/json"},
        )
        with urllib.request.urlopen(asked, timeout=30) as reply:
            assert json.load(reply) == {"prompt": "<hi><yo>"}  # the template given
        assert card["draft"] == {"id": "ngram", "available": True, "max_draft_tokens": 10}
        assert (card["id"], card["max_model_len"]) == ("tiny-coder", 200)
        auth = [("authorization", f"Bearer {key}")]
        with SpecdClient(f"127.0.0.1:{router}") as client:
            with pytest.raises(grpc.RpcError) as denied:
                client.generate("abc", max_new_tokens=4)
            assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
            r = client.generate(
                "abcabcabcabc",
                max_new_tokens=32,
                ignore_eos=True,
                route="chat",
                speculation="on",
                metadata=auth,
            )
        assert r.speculation.num_draft_tokens == 10  # every route's k, chat's 3 included
        assert r.speculation.rounds > 0, r.speculation
        # `specd generate` sends the key from $SPECD_API_KEY, as `specd up` reads it
        asked = ["generate", "--address", f"127.0.0.1:{router}", "--max-new-tokens", "4", "ab"]
        monkeypatch.delenv("SPECD_API_KEY", raising=False)
        assert main(asked) == 1
        assert "UNAUTHENTICATED" in capsys.readouterr().err
        monkeypatch.setenv("SPECD_API_KEY", key)
        assert main(asked) == 0
    finally:
        code = up.stop(60)
    assert code == 0, up.text()[-3000:]
