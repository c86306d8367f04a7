"""`specd bench predict`: code edits returned whole, with and without OpenAI's predicted
output (`prediction`), through the chat endpoint; llama-server (which takes none) on the
same bodies, same run.

    specd bench predict --http http://127.0.0.1:8000 [--modes off,auto,auto+prediction]
                        [--peer llamacpp,llamacpp-draft] [--repeats 3] [--max-tokens 512]

Each request is one of the `edit` workload's (a change asked of a code block, the whole
code to come back), greedy. A mode written `MODE+prediction` sends the prompt's code block
as the prediction, as an editor's "apply" does. Every body is sent once untimed first
(one token: each server's prompt cache as a user's editor leaves it), then `--repeats`
timed passes of specd's modes taking turns (their order reversed every other), then of
each llama-server variant (bench/llamacpp.py), one request at a time. Tokens/s is the
completion tokens over the pass's wall time. The report gives each one's median, its
ratio to specd `off` and to llama-server plain, the predicted tokens taken and not (the
usage's `completion_tokens_details`), and whether each one's answers were specd `off`'s.
"""

from __future__ import annotations

import argparse
import re
import statistics
import tempfile
import time

from bench import http_peers
from bench.http_peers import add_flags, add_ratios, ratio_cells
from bench.llamacpp import server
from bench.prompts import load_items

CODE = re.compile(r"```[\w+-]*\n(.*?)```", re.S)


def bodies(workload: str, max_tokens: int) -> list[tuple[dict, str]]:
    """Each request's greedy chat body and the code block its prompt asks to edit."""
    out = []
    for item in load_items(workload):
        code = CODE.search(item["messages"][-1]["content"]).group(1)
        body = {"messages": item["messages"], "max_tokens": max_tokens, "temperature": 0.0}
        out.append((body, code))
    return out


def post(url: str, body: dict) -> dict:
    return http_peers.post(url, "/v1/chat/completions", body)


def one_pass(url: str, asked: list[tuple[dict, str]], extra: dict, predict: bool) -> dict:
    start, tokens, texts, taken = time.perf_counter(), 0, [], None
    for body, code in asked:
        prediction = {"prediction": {"type": "content", "content": code}} if predict else {}
        answer = post(url, {**body, **extra, **prediction})
        tokens += answer["usage"]["completion_tokens"]
        texts.append(answer["choices"][0]["message"]["content"])
        details = answer["usage"].get("completion_tokens_details")
        if details is not None:  # answered where a prediction was sent
            taken = taken or [0, 0]
            taken[0] += details["accepted_prediction_tokens"]
            taken[1] += details["rejected_prediction_tokens"]
    wall = time.perf_counter() - start
    return {
        "tokens": tokens,
        "tokens_per_s": tokens / wall,
        "texts": texts,
        "taken": taken,
    }


def run(url, peers, modes, asked, repeats, model, draft) -> dict:
    targets = []
    for m in modes:
        mode, _, extra = m.partition("+")
        targets.append((f"specd {m}", url, {"speculation": mode}, extra == "prediction"))
    results: dict[str, list[dict]] = {name: [] for name, *_ in targets}
    for _, address, extra, _ in targets:
        _warm(address, asked, extra)
    for r in range(repeats):  # specd's modes take turns, their order reversed every other
        for name, address, extra, predict in targets[:: -1 if r % 2 else 1]:
            results[name].append(one_pass(address, asked, extra, predict))
    for name in results:
        _report_line(name, results[name])
    with tempfile.TemporaryDirectory() as logs:
        for peer in peers:
            with server(peer, model, draft, 1, logs) as port:
                address = f"http://127.0.0.1:{port}"
                _warm(address, asked, {})
                results[peer] = [one_pass(address, asked, {}, False) for _ in range(repeats)]
                _report_line(peer, results[peer])
    first = next(iter(results.values()))[0]["texts"]  # the first mode's (`off`) answers
    rows = {
        name: {
            "tokens_per_s": statistics.median(p["tokens_per_s"] for p in passes),
            "tokens": [p["tokens"] for p in passes],
            "predicted": passes[0]["taken"],
            "same answers": sum(a == b for a, b in zip(passes[0]["texts"], first, strict=True)),
        }
        for name, passes in results.items()
    }
    add_ratios(rows)
    return {"requests": len(asked), "repeats": repeats, "rows": rows}


def _warm(address: str, asked, extra: dict) -> None:
    """Each prompt once, untimed: cached as an editor's earlier call leaves it."""
    for body, _ in asked:
        post(address, {**body, **extra, "max_tokens": 1})


def _report_line(name: str, passes: list[dict]) -> None:
    rates = ", ".join(f"{p['tokens_per_s']:.1f}" for p in passes)
    print(f"  {name:<24} tok/s per pass: {rates}", flush=True)


def to_markdown(report: dict) -> str:
    lines = [
        "| server | tok/s (median) | / specd off | / llama-server | predicted tokens taken,"
        " not | answers as specd off's |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, row in report["rows"].items():
        cells = ratio_cells(row)
        predicted = "-" if row["predicted"] is None else ", ".join(map(str, row["predicted"]))
        same = f"{row['same answers']} of {report['requests']}"
        lines.append(f"| {name} | {row['tokens_per_s']:.1f} | {cells} | {predicted} | {same} |")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specd bench predict", description=__doc__.split("\n")[0])
    add_flags(p, "off,auto,auto+prediction", "specd's speculation modes, +prediction to send one")
    p.add_argument("--workload", default="edit", help="edit prompts (%(default)s)")
    p.add_argument("--max-tokens", type=int, default=512, help="tokens at most (%(default)s)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return http_peers.main(args, bodies(args.workload, args.max_tokens), run, to_markdown)


if __name__ == "__main__":
    raise SystemExit(main())
