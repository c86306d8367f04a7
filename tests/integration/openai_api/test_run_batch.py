"""`specd run-batch`: an OpenAI batch file through the door, answered line by line in the
input's order, each answer the one the door gives the same body; lines that are not
requests are answered without being sent; a batch that cannot run says why."""

import asyncio
import json
import subprocess
import sys

import pytest

from launcher import run_batch
from launcher.cli import main
from launcher.processes import free_port
from tests.cluster import TINY_MODEL_ID
from tests.integration.openai_api.door import TOKEN, url

CHAT = {"model": TINY_MODEL_ID, "messages": [{"role": "user", "content": "ab"}]}


def _line(custom_id: str, endpoint: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": endpoint, "body": body})


def _run(tmp_path, lines: list[str | bytes], *flags: str) -> tuple[int, list[dict]]:
    batch, answers = tmp_path / "batch.jsonl", tmp_path / "answers.jsonl"
    raw = [x if isinstance(x, bytes) else x.encode() for x in lines]
    batch.write_bytes(b"\n".join(raw) + b"\n")
    code = main(["run-batch", "-i", str(batch), "-o", str(answers), *flags])
    out = [json.loads(x) for x in answers.read_text().splitlines()] if answers.exists() else []
    return code, out


def test_a_batch_is_answered_line_by_line_as_the_door_answers_each(cluster, client, tmp_path):
    bodies = [{**CHAT, "max_tokens": n, "temperature": 0, "seed": n} for n in (24, 3, 12, 1, 16, 8)]
    lines = [_line(f"chat-{i}", "/v1/chat/completions", b) for i, b in enumerate(bodies)]
    prompt = {"model": TINY_MODEL_ID, "prompt": "abc", "max_tokens": 10, "temperature": 0}
    lines.append(_line("completion", "/v1/completions", prompt))
    lines.append(_line("refused", "/v1/chat/completions", {**CHAT, "temperature": -1}))
    lines += [
        "not json",
        b"\xff\xfe not UTF-8",
        _line("chat-0", "/v1/chat/completions", CHAT),  # a custom_id already used
        _line("embed", "/v1/embeddings", {"input": "x"}),
        _line("streamed", "/v1/chat/completions", {**CHAT, "stream": True}),
    ]
    code, out = _run(tmp_path, lines, "--url", url(cluster), "--concurrency", "3")
    assert code == 0
    assert [o["custom_id"] for o in out] == [
        *(f"chat-{i}" for i in range(6)), "completion", "refused", None, None, "chat-0",
        "embed", "streamed",
    ]  # fmt: skip
    for body, answer in zip(bodies, out, strict=False):
        alone = client.chat.completions.create(**body)
        assert answer["error"] is None and answer["response"]["status_code"] == 200
        got = answer["response"]["body"]
        assert got["choices"][0]["message"]["content"] == alone.choices[0].message.content
        assert got["usage"]["completion_tokens"] == alone.usage.completion_tokens
        assert got["id"] == f"chatcmpl-{answer['response']['request_id']}"  # the same request
    done = out[6]["response"]["body"]
    assert done["choices"][0]["text"] == client.completions.create(**prompt).choices[0].text
    refused = out[7]
    assert refused["response"]["status_code"] == 400 and refused["response"]["body"] is None
    assert "temperature" in refused["error"]["error"]["message"]  # the door's own error
    said = [o["error"] for o in out[8:]]
    assert said[0].startswith("not JSON")
    assert said[1].startswith("not UTF-8")
    assert said[2] == "custom_id 'chat-0' repeats line 1"
    assert said[3].startswith("url: one of /v1/chat/completions, /v1/completions")
    assert said[4] == "body.stream: a batch's answers are not streamed"
    assert all(o["response"]["status_code"] == 400 for o in out[8:])


def test_a_line_is_read_once_a_request_is_free(cluster, tmp_path, monkeypatch):
    """A batch of millions is never held whole: `--concurrency` lines ahead of the last
    answered at most."""
    answered, ahead = [0], []
    send = run_batch._send

    async def counted(*args):
        out = await send(*args)
        answered[0] += 1
        return out

    def lines():
        for i in range(12):
            ahead.append(i - answered[0])
            body = {**CHAT, "max_tokens": 2 + i % 5, "temperature": 0}
            yield run_batch.Line(f"x{i}", "/v1/chat/completions", body)

    monkeypatch.setattr(run_batch, "_send", counted)
    path = tmp_path / "answers.jsonl"
    counts = asyncio.run(run_batch.run(lines(), url(cluster), str(path), 3))
    assert counts["lines"] == counts["ok"] == 12
    assert max(ahead) == 3  # three in flight, the fourth read once one is answered
    assert [json.loads(x)["custom_id"] for x in path.read_text().splitlines()] == [
        f"x{i}" for i in range(12)
    ]


def test_the_route_and_the_token_reach_the_door(cluster, tmp_path):
    lines = [_line("x", "/v1/chat/completions", {**CHAT, "max_tokens": 4, "temperature": 0})]
    code, out = _run(tmp_path, lines, "--url", url(cluster), "--route", "batch")
    assert code == 0
    speculation = out[0]["response"]["body"]["speculation"]
    assert speculation["arrival_reason"] == "off:policy"  # the test policy's batch route
    code, out = _run(tmp_path, lines, "--url", url(cluster))
    assert out[0]["response"]["body"]["speculation"]["arrival_reason"] != "off:policy"
    code, out = _run(tmp_path, lines, "--url", url(cluster, 0), "--api-key", TOKEN)
    assert code == 0 and out[0]["response"]["status_code"] == 200


@pytest.mark.parametrize("case", ["no token", "no server", "no input", "no concurrency"])
def test_a_batch_that_cannot_run_says_why_and_writes_nothing(cluster, tmp_path, capsys, case):
    lines = [_line("x", "/v1/chat/completions", CHAT)]
    flags = {
        "no token": ["--url", url(cluster, 0)],
        "no server": ["--url", f"http://127.0.0.1:{free_port()}"],
        "no input": ["--url", url(cluster), "-i", str(tmp_path / "absent.jsonl")],
        "no concurrency": ["--url", url(cluster), "--concurrency", "0"],
    }[case]
    code, out = _run(tmp_path, lines, *flags)
    err = capsys.readouterr().err
    assert code == 2 and out == [], err
    assert err.startswith("specd run-batch: ") and "Traceback" not in err
    assert {
        "no token": "/v1/models answered 401",
        "no server": "no server at http://127.0.0.1:",
        "no input": "cannot read ",
        "no concurrency": "--concurrency must be at least 1",
    }[case] in err


def test_the_batch_client_loads_no_torch():
    """It runs from any machine that reaches the door: `specd run-batch`'s imports."""
    check = "import sys, launcher.cli, launcher.run_batch; print('torch' in sys.modules)"
    said = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
    assert said.stdout.strip() == "False", said.stderr
