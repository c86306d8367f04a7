"""`specd bench doors`: what the OpenAI HTTP door costs against gRPC, same router, same run.

    specd bench doors [--target HOST:PORT --http URL] [--concurrency 1,8] [--repeats 3]
                      [--requests 16] [--max-new-tokens 128] [--workload chat]

Each cell sends `--requests` streamed chat requests from `--concurrency` concurrent
clients, greedy, once through gRPC `GenerateStream` and once through `POST
/v1/chat/completions` with `stream: true` (aiohttp's client, SSE parsed as it arrives; the
token count comes from `return_token_ids`, so both doors count the same tokens). The doors
alternate (ABBA) over `--repeats` rounds so drift on a shared machine hits both; the report
gives each door's median tokens/s and median TTFT p50 per concurrency and their ratios.
Without --target it starts a drafter, verifier and router (with --http-port) itself.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import time
from pathlib import Path

import grpc

from bench import flags
from bench.prompts import load_conversations
from bench.sweep import add_service_args, drive, stream_one
from bench.sweep_report import percentile
from protos.specd.v1 import router_pb2_grpc


async def _one_http(session, url: str, model: str, messages, max_new: int) -> dict:
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_new,
        "temperature": 0,
        "stream": True,
        "return_token_ids": True,
    }
    start = time.perf_counter()
    first, tokens = None, 0
    async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(line[6:])
            ids = chunk["choices"][0].get("token_ids", []) if chunk.get("choices") else []
            if ids and first is None:
                first = time.perf_counter()
            tokens += len(ids)
    end = time.perf_counter()
    return {"ttft": (first or end) - start, "tokens": tokens}


async def _clients(one, conversations, concurrency: int, requests: int) -> dict:
    results, wall = await drive(one, conversations, concurrency, requests)
    tokens = sum(r["tokens"] for r in results)
    return {
        "tokens": tokens,
        "tokens_per_s": tokens / wall,
        "ttft_p50": percentile([r["ttft"] for r in results], 0.5),
    }


async def grpc_cell(address, conversations, concurrency, requests, max_new) -> dict:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = router_pb2_grpc.GenerationStub(channel)
        return await _clients(
            lambda m: stream_one(stub, m, "auto", max_new), conversations, concurrency, requests
        )


async def http_cell(url, model, conversations, concurrency, requests, max_new) -> dict:
    import aiohttp

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        return await _clients(
            lambda m: _one_http(session, url, model, m, max_new),
            conversations,
            concurrency,
            requests,
        )


def compare(address, url, model, conversations, levels, repeats, requests, max_new) -> dict:
    asyncio.run(grpc_cell(address, conversations, 1, 1, max_new))  # warm both paths up
    asyncio.run(http_cell(url, model, conversations, 1, 1, max_new))
    rows = []
    for c in levels:
        runs = {"grpc": [], "http": []}
        for r in range(repeats):
            order = ("grpc", "http") if r % 2 == 0 else ("http", "grpc")
            for door in order:
                n = max(requests, c)
                if door == "grpc":
                    cell = grpc_cell(address, conversations, c, n, max_new)
                else:
                    cell = http_cell(url, model, conversations, c, n, max_new)
                runs[door].append(asyncio.run(cell))
                last = runs[door][-1]
                print(
                    f"  c={c:<2} {door:<4} {last['tokens_per_s']:7.2f} tok/s  "
                    f"TTFT p50 {last['ttft_p50'] * 1000:6.0f} ms",
                    flush=True,
                )
        row = {"concurrency": c}
        for door, cells in runs.items():
            row[f"{door}_tokens_per_s"] = statistics.median(x["tokens_per_s"] for x in cells)
            row[f"{door}_ttft_p50"] = statistics.median(x["ttft_p50"] for x in cells)
            row[f"{door}_tokens"] = sorted({x["tokens"] for x in cells})
        row["http_over_grpc_tokens_per_s"] = row["http_tokens_per_s"] / row["grpc_tokens_per_s"]
        row["http_minus_grpc_ttft_ms"] = 1000 * (row["http_ttft_p50"] - row["grpc_ttft_p50"])
        rows.append(row)
    return {"max_new_tokens": max_new, "repeats": repeats, "rows": rows}


def to_markdown(report: dict) -> str:
    lines = [
        "| concurrency | gRPC tok/s | HTTP tok/s | HTTP / gRPC | gRPC TTFT p50 | HTTP TTFT p50 |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['concurrency']} | {r['grpc_tokens_per_s']:.2f} | "
            f"{r['http_tokens_per_s']:.2f} | {r['http_over_grpc_tokens_per_s']:.3f} | "
            f"{r['grpc_ttft_p50'] * 1000:.0f} ms | {r['http_ttft_p50'] * 1000:.0f} ms |"
        )
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specd bench doors", description=__doc__.split("\n")[0])
    add_service_args(p)
    p.add_argument("--http", default="", help="its HTTP door, e.g. http://127.0.0.1:8000")
    p.add_argument("--served-model", default="", help="the model id (default: /v1/models)")
    p.add_argument("--workload", default="chat", help=flags.workload())
    p.add_argument("--concurrency", default="1,8", help=flags.CONCURRENCY)
    p.add_argument(
        "--repeats", type=int, default=3, help="rounds, the doors in A B B A order (%(default)s)"
    )
    p.add_argument("--requests", type=int, default=16, help="requests a cell sends (%(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=128, help=flags.MAX_NEW_TOKENS)
    p.add_argument("--json", help="also write the report here")
    return p


@contextlib.contextmanager
def _doors(args):
    """(gRPC address, HTTP url) of --target/--http, or of services started here."""
    if args.target:
        yield args.target, args.http.rstrip("/")
        return
    from launcher.processes import free_port, services_running

    port = free_port()
    flags = {"router_flags": ("--http-port", str(port))}
    with services_running(
        args.model, args.draft_model, args.dtype, "specd-doors-", **flags
    ) as services:
        yield services["router"].address, f"http://127.0.0.1:{port}"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    conversations = load_conversations(args.workload)
    levels = [int(x) for x in args.concurrency.split(",")]
    with _doors(args) as (address, url):
        model = args.served_model or _served_model(url)
        report = compare(
            address,
            url,
            model,
            conversations,
            levels,
            args.repeats,
            args.requests,
            args.max_new_tokens,
        )
    print(to_markdown(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


def _served_model(url: str) -> str:
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as resp:
            return json.loads(resp.read())["data"][0]["id"]
    except OSError as exc:  # urllib's URLError: the door is not there
        raise SystemExit(f"specd bench doors: cannot reach {url}: {exc}") from None


if __name__ == "__main__":
    raise SystemExit(main())
