"""`specd run-batch`: an OpenAI batch file (JSONL, one request a line: `custom_id`,
`method`, `url`, `body`) sent to a running specd's HTTP door, its answers written as a
batch output file, one line per request line in the same order, as vLLM's `run-batch`
and the OpenAI Batch API write them:

    {"id": "batch_req_...", "custom_id": "...",
     "response": {"status_code": 200, "request_id": "...", "body": {...}}, "error": null}

A request the server refused keeps its status and error body; a line that is not a
request (not UTF-8 JSON, an endpoint the door does not serve, a streamed body, a `custom_id`
already used) is answered with status 400 and `error` saying why, and sent nowhere.
Requests run `--concurrency` at a time, each line read once one is free; the client needs
neither torch nor the models."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import aiohttp

# the door's generation endpoints a batch line may name (OpenAI's batch endpoints it has)
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")


class BatchError(Exception):
    """The batch cannot run at all: an unreadable input, a server that is not there."""


@dataclass
class Line:
    """One input line: its request, or why it is not one (`refused`)."""

    custom_id: str | None
    url: str = ""
    body: dict | None = None
    refused: str = ""


def read_lines(raw_lines: Iterable[bytes]) -> Iterator[Line]:
    """The input's non-empty lines as requests, each checked alone, read as they are
    taken (a batch of millions is never held whole)."""
    seen: dict[str, int] = {}
    for number, raw in enumerate(raw_lines, 1):
        if raw.strip():
            line = _line(raw)
            if line.custom_id is not None and not line.refused:
                if line.custom_id in seen:
                    line.refused = (
                        f"custom_id {line.custom_id!r} repeats line {seen[line.custom_id]}"
                    )
                else:
                    seen[line.custom_id] = number
            yield line


def _line(raw: bytes) -> Line:
    try:
        item = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        return Line(None, refused=f"not UTF-8: {exc}")
    except json.JSONDecodeError as exc:
        return Line(None, refused=f"not JSON: {exc}")
    if not isinstance(item, dict):
        return Line(None, refused="a batch line is a JSON object")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str):
        return Line(None, refused="custom_id: a string is required")
    url, body = item.get("url"), item.get("body")
    if item.get("method") != "POST":
        return Line(custom_id, refused=f"method: POST is the only one, got {item.get('method')!r}")
    if url not in ENDPOINTS:
        return Line(custom_id, refused=f"url: one of {', '.join(ENDPOINTS)}, got {url!r}")
    if not isinstance(body, dict):
        return Line(custom_id, refused="body: a JSON object is required")
    if body.get("stream"):
        return Line(custom_id, refused="body.stream: a batch's answers are not streamed")
    return Line(custom_id, url, body)


def _output(custom_id, status: int, request_id: str, body, error) -> dict:
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": request_id, "body": body},
        "error": error,
    }


async def _send(session, base: str, line: Line, headers: dict) -> dict:
    request_id = f"batch-{uuid.uuid4().hex}"
    if line.refused:
        return _output(line.custom_id, 400, request_id, None, line.refused)
    try:
        async with session.post(
            base + line.url, json=line.body, headers={**headers, "x-request-id": request_id}
        ) as response:
            text = await response.text()
            status = response.status
    except aiohttp.ClientError as exc:
        return _output(line.custom_id, 502, request_id, None, f"the server: {exc}")
    try:
        answer = json.loads(text)
    except json.JSONDecodeError:
        answer = None
    if status == 200:
        return _output(line.custom_id, status, request_id, answer, None)
    return _output(line.custom_id, status, request_id, None, answer or text)


async def run(
    lines: Iterable[Line], base: str, path: str, concurrency: int, token: str = "", route: str = ""
) -> dict:
    """Send `lines` to the door at `base`, `concurrency` at a time (as `route`'s requests,
    where one is named; a line is read once one of those is free), and write each answer
    to the file at `path` in the input's order as soon as those before it are written;
    returns the counts (ok, failed, prompt and completion tokens)."""
    headers = {"authorization": f"Bearer {token}"} if token else {}
    headers |= {"x-route": route} if route else {}
    gate = asyncio.Semaphore(concurrency)
    done: dict[int, dict] = {}
    counts = {"lines": 0, "ok": 0, "failed": 0, "prompt_tokens": 0, "completion_tokens": 0}
    written = 0

    async def one(i: int, line: Line) -> None:
        nonlocal written
        try:
            done[i] = await _send(session, base, line, headers)
        finally:
            gate.release()
        while written in done:  # in order: the next line waits for those before it
            answer = done.pop(written)
            out.write(json.dumps(answer) + "\n")
            _count(answer, counts)
            written += 1

    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await _ready(session, base, headers)  # before the output file is opened
        try:
            out = open(path, "w", encoding="utf-8")  # noqa: SIM115 (closed below)
        except OSError as exc:
            raise BatchError(f"cannot write {path}: {exc}") from None
        with out:
            async with asyncio.TaskGroup() as group:
                for i, line in enumerate(lines):
                    await gate.acquire()
                    group.create_task(one(i, line))
    return counts


async def _ready(session, base: str, headers: dict) -> None:
    try:
        async with session.get(base + "/v1/models", headers=headers) as response:
            if response.status != 200:
                said = (await response.text())[:300]
                raise BatchError(f"{base}/v1/models answered {response.status}: {said}")
    except aiohttp.ClientError as exc:
        raise BatchError(f"no server at {base} ({exc}); start one with `specd up`") from None


def _count(answer: dict, counts: dict) -> None:
    counts["lines"] += 1
    body = answer["response"]["body"]
    if answer["error"] is not None or not isinstance(body, dict):
        counts["failed"] += 1
        return
    counts["ok"] += 1
    usage = body.get("usage") or {}
    counts["prompt_tokens"] += usage.get("prompt_tokens", usage.get("input_tokens", 0))
    counts["completion_tokens"] += usage.get("completion_tokens", usage.get("output_tokens", 0))


def main(args) -> int:
    """`specd run-batch`: 0 once every line has an answer line (refusals included), 2
    where the batch could not run (said in one line)."""
    try:
        return _main(args)
    except BatchError as exc:
        print(f"specd run-batch: {exc}", file=sys.stderr)
        return 2


def _main(args) -> int:
    if args.concurrency < 1:
        raise BatchError(f"--concurrency must be at least 1, got {args.concurrency}")
    token = args.api_key or os.environ.get("OPENAI_API_KEY", "")
    start = time.perf_counter()
    base = args.url.rstrip("/")
    try:
        f = open(args.input_file, "rb")  # noqa: SIM115 (closed below)
    except OSError as exc:
        raise BatchError(f"cannot read {args.input_file}: {exc}") from None
    with f:
        counts = asyncio.run(
            run(read_lines(f), base, args.output_file, args.concurrency, token, args.route)
        )
    seconds = time.perf_counter() - start
    print(
        f"specd run-batch: {counts['lines']} requests, {counts['ok']} answered, "
        f"{counts['failed']} failed; {counts['prompt_tokens']} prompt and "
        f"{counts['completion_tokens']} completion tokens in {seconds:.1f} s "
        f"({counts['completion_tokens'] / max(seconds, 1e-9):.1f} tokens/s) -> {args.output_file}",
        file=sys.stderr,
    )
    return 0
