"""`specd bench structured`: JSON-schema generation with speculation on and off, and what
the constraint costs against the same requests unconstrained, in one run.

    specd bench structured [--target HOST:PORT] [--workload structured] [--repeats 2]
                           [--peer llamacpp]
                           [--max-new-tokens 160] [--json FILE]

Each workload item is a chat request and the JSON schema its answer must follow (function
call arguments, records extracted from text). Four settings, greedy, concurrency 1:
constrained on/off and unconstrained on/off, run in ABBA order over `--repeats` rounds so
drift on a shared machine hits all of them. The report gives tokens/s, acceptance and
tokens per round for each; the ratios on/off and constrained/unconstrained; how many
constrained outputs validate against their schema (jsonschema); and whether greedy output
was token-for-token the same with speculation on and off. Without --target it starts a
drafter, verifier and router (the default pair) itself. `--peer llamacpp` then runs the
same requests through llama.cpp's server (`make peer-llamacpp`), plain decoding of the same
GGUF, with the schema as its `response_format` and without, after specd's services stop.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import grpc

from bench import flags
from bench.prompts import load_items
from bench.sweep import add_service_args
from protos.specd.v1 import router_pb2_grpc
from router.client import build_request

SETTINGS = [("json", "on"), ("json", "off"), ("free", "off"), ("free", "on")]


async def _one(stub, item: dict, constrained: bool, mode: str, max_new: int) -> dict:
    schema = item["schema"] if constrained else None
    request = build_request(
        messages=item["messages"], max_new_tokens=max_new, speculation=mode, json_schema=schema
    )
    start = time.perf_counter()
    ids, text, final = [], [], None
    async for msg in stub.GenerateStream(request):
        ids.extend(msg.token_ids)
        text.append(msg.text)
        final = msg if msg.finish_reason else final
    return {
        "seconds": time.perf_counter() - start,
        "tokens": len(ids),
        "ids": ids,
        "text": "".join(text),
        "finish": final.finish_reason,
        "drafted": final.speculation.drafted,
        "accepted": final.speculation.accepted,
        "rounds": final.speculation.rounds,
    }


def _valid(item: dict, result: dict) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(result["text"]), item["schema"])
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


async def run(address: str, items: list[dict], repeats: int, max_new: int) -> dict:
    runs: dict[tuple, list] = {s: [] for s in SETTINGS}
    async with grpc.aio.insecure_channel(address) as channel:
        stub = router_pb2_grpc.GenerationStub(channel)
        await _one(stub, items[0], True, "on", 8)  # warm up (compiles the grammar path)
        for r in range(repeats):
            order = SETTINGS if r % 2 == 0 else SETTINGS[::-1]
            for kind, mode in order:
                cell = [await _one(stub, it, kind == "json", mode, max_new) for it in items]
                runs[(kind, mode)].append(cell)
                tokens = sum(len(x["ids"]) for x in cell)
                seconds = sum(x["seconds"] for x in cell)
                print(f"  {kind:<4} {mode:<3} {tokens / seconds:6.2f} tok/s", flush=True)
    return runs


def llamacpp_runs(items, repeats: int, max_new: int, model: str) -> dict:
    """The same requests through llama.cpp's server (plain decoding, the same GGUF), with
    the schema as `response_format` and without, alternating."""
    from bench.llamacpp import chat, server

    runs: dict[tuple, list] = {("json", "llamacpp"): [], ("free", "llamacpp"): []}
    with server("llamacpp", model, "", 1, tempfile.mkdtemp(prefix="specd-peer-")) as port:
        for r in range(repeats):
            for kind in ("json", "free") if r % 2 == 0 else ("free", "json"):
                cell = []
                for it in items:
                    extra = {}
                    if kind == "json":
                        schema = {"name": "answer", "schema": it["schema"]}
                        extra["response_format"] = {"type": "json_schema", "json_schema": schema}
                    start = time.perf_counter()
                    reply = chat(port, it["messages"], max_new, **extra)
                    choice = reply["choices"][0]
                    cell.append(
                        {
                            "seconds": time.perf_counter() - start,
                            "tokens": reply["usage"]["completion_tokens"],
                            "text": choice["message"]["content"],
                            "finish": choice["finish_reason"],
                        }
                    )
                runs[(kind, "llamacpp")].append(cell)
                rate = sum(x["tokens"] for x in cell) / sum(x["seconds"] for x in cell)
                print(f"  {kind:<4} llamacpp {rate:6.2f} tok/s", flush=True)
    return runs


def summarise(items, runs, max_new: int) -> dict:
    rows = {}
    for (kind, mode), cells in runs.items():
        flat = [x for cell in cells for x in cell]
        drafted = sum(x.get("drafted", 0) for x in flat)
        rounds = sum(x.get("rounds", 0) for x in flat)
        accepted = sum(x.get("accepted", 0) for x in flat)
        rows[f"{kind}-{mode}"] = {
            "tokens_per_s": sum(x["tokens"] for x in flat) / sum(x["seconds"] for x in flat),
            "tokens_per_request": sum(x["tokens"] for x in flat) / len(flat),
            "acceptance": accepted / drafted if drafted else 0.0,
            "tokens_per_round": (accepted + rounds) / rounds if rounds else 1.0,
            "valid_json": sum(_valid(it, x) for c in cells for it, x in zip(items, c, strict=True)),
            "finished": sum(x["finish"] == "stop" for x in flat),
            "outputs": len(flat),
        }
    same = sum(
        a["ids"] == b["ids"]
        for ca, cb in zip(runs[("json", "on")], runs[("json", "off")], strict=True)
        for a, b in zip(ca, cb, strict=True)
    )
    r = rows
    peer = {}
    if "json-llamacpp" in r:
        peer = {
            "json_on_over_llamacpp_json": r["json-on"]["tokens_per_s"]
            / r["json-llamacpp"]["tokens_per_s"],
            "free_off_over_llamacpp_free": r["free-off"]["tokens_per_s"]
            / r["free-llamacpp"]["tokens_per_s"],
        }
    return {
        **peer,
        "max_new_tokens": max_new,
        "rows": rows,
        "json_on_over_off": r["json-on"]["tokens_per_s"] / r["json-off"]["tokens_per_s"],
        "free_on_over_off": r["free-on"]["tokens_per_s"] / r["free-off"]["tokens_per_s"],
        "json_over_free_on": r["json-on"]["tokens_per_s"] / r["free-on"]["tokens_per_s"],
        "json_over_free_off": r["json-off"]["tokens_per_s"] / r["free-off"]["tokens_per_s"],
        "greedy_identical_on_off": f"{same}/{len(runs[('json', 'on')]) * len(items)}",
    }


def to_markdown(report: dict) -> str:
    lines = [
        "| setting | tok/s | tokens per request | acceptance | tokens/round | valid JSON |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, row in report["rows"].items():
        lines.append(
            f"| {name} | {row['tokens_per_s']:.2f} | {row['tokens_per_request']:.0f} | "
            f"{row['acceptance']:.2f} | {row['tokens_per_round']:.2f} | "
            f"{row['valid_json']}/{row['outputs']} |"
        )
    lines.append("")
    lines.append(
        f"constrained on/off {report['json_on_over_off']:.2f}x, unconstrained on/off "
        f"{report['free_on_over_off']:.2f}x; constrained/unconstrained: on "
        f"{report['json_over_free_on']:.3f}, off {report['json_over_free_off']:.3f}; "
        f"greedy identical on/off (constrained): {report['greedy_identical_on_off']}"
    )
    if "json_on_over_llamacpp_json" in report:
        lines.append(
            f"against llama.cpp (plain decoding, same GGUF): constrained specd-on / llama.cpp "
            f"{report['json_on_over_llamacpp_json']:.2f}x, unconstrained specd-off / llama.cpp "
            f"{report['free_off_over_llamacpp_free']:.2f}x"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specd bench structured", description=__doc__.split("\n")[0])
    add_service_args(p)
    p.add_argument("--workload", default="structured", help=flags.workload())
    p.add_argument("--repeats", type=int, default=2, help="rounds, in A B B A order (%(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=160, help=flags.MAX_NEW_TOKENS)
    p.add_argument(
        "--peer",
        choices=["none", "llamacpp"],
        default="none",
        help="also llama-server with the same schemas (default: %(default)s)",
    )
    p.add_argument("--json", help="also write the report here")
    args = p.parse_args(argv)
    items = load_items(args.workload)
    if args.target:
        runs = asyncio.run(run(args.target, items, args.repeats, args.max_new_tokens))
    else:
        from launcher.processes import services_running

        with services_running(args.model, args.draft_model, args.dtype, "specd-structured-") as s:
            runs = asyncio.run(run(s["router"].address, items, args.repeats, args.max_new_tokens))
    if args.peer == "llamacpp":  # after specd's services stopped: the cores are its alone
        runs |= llamacpp_runs(items, args.repeats, args.max_new_tokens, args.model)
    report = summarise(items, runs, args.max_new_tokens)
    print(to_markdown(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
