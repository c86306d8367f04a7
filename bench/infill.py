"""`specd bench infill`: code completion as llama.vscode asks for it, through specd's
/infill and llama-server's, same bodies, same run.

    specd bench infill --http http://127.0.0.1:8000 [--modes off,auto]
                       [--peer llamacpp,llamacpp-draft] [--repeats 3] [--n-predict 64]

Each request is llama.vscode's body for one of the `fim` workload's gaps (its prefix and
suffix, no extra files): `top_k: 40, top_p: 0.99, samplers: [top_k, top_p, infill]`,
llama.cpp's infill sampler at temperature 1, a seed per request, `n_indent` and
`t_max_predict_ms` off so that every request runs until the model ends the middle or
`--n-predict`. Every body is sent once untimed first with `n_predict: 0` (llama.vscode
warms its cache so), then the timed passes go through specd's modes (the body's
`speculation`) and each llama-server variant (bench/llamacpp.py: plain, with the draft
model) in turn, `--repeats` times each, one request at a time. Tokens/s is the predicted
tokens over the pass's wall time; the report gives each one's median and its ratio to
specd `off` and to llama-server plain, and the share of drafts accepted where the answers
tell it (`timings.draft_n` and `draft_n_accepted`, specd's as llama-server's own).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from bench import http_peers
from bench.http_peers import add_flags, add_ratios, ratio_cells
from bench.llamacpp import server
from bench.prompts import load_items
from router.fim import MARKERS


def bodies(workload: str, n_predict: int) -> list[dict]:
    """llama.vscode's /infill body for each gap of the workload's FIM prompts."""
    out = []
    for i, item in enumerate(load_items(workload)):
        prompt = item["prompt"]
        before, after, middle = next(m for m in MARKERS if m[0] in prompt)
        prefix, rest = prompt.removeprefix(before).split(after, 1)
        out.append(
            {
                "input_prefix": prefix,
                "input_suffix": rest.removesuffix(middle),
                "input_extra": [],
                "prompt": "",
                "n_predict": n_predict,
                "top_k": 40,
                "top_p": 0.99,
                "samplers": ["top_k", "top_p", "infill"],
                "stream": False,
                "cache_prompt": True,
                "seed": i,
            }
        )
    return out


def post(url: str, body: dict) -> dict:
    return http_peers.post(url, "/infill", body)


def one_pass(url: str, bodies_: list[dict], extra: dict) -> dict:
    start, tokens, texts, drafted, accepted = time.perf_counter(), 0, [], 0, 0
    for body in bodies_:
        answer = post(url, {**body, **extra})
        tokens += answer["tokens_predicted"]
        texts.append(answer["content"])
        drafted += answer["timings"].get("draft_n", 0)
        accepted += answer["timings"].get("draft_n_accepted", 0)
    wall = time.perf_counter() - start
    rate = accepted / drafted if drafted else None
    return {"tokens": tokens, "tokens_per_s": tokens / wall, "texts": texts, "acceptance": rate}


def run(url, peers, modes, bodies_, repeats, model, draft) -> dict:
    targets = [(f"specd {m}", url, {"speculation": m}) for m in modes]
    results: dict[str, list[dict]] = {}
    for name, address, extra in targets:
        for body in bodies_:
            post(address, {**body, **extra, "n_predict": 0})
        results[name] = [one_pass(address, bodies_, extra) for _ in range(repeats)]
        _report_line(name, results[name])
    with tempfile.TemporaryDirectory() as logs:
        for peer in peers:
            with server(peer, model, draft, 1, logs) as port:
                address = f"http://127.0.0.1:{port}"
                for body in bodies_:
                    post(address, {**body, "n_predict": 0})
                results[peer] = [one_pass(address, bodies_, {}) for _ in range(repeats)]
                _report_line(peer, results[peer])
    rows = {
        name: {
            "tokens_per_s": statistics.median(p["tokens_per_s"] for p in passes),
            "tokens": [p["tokens"] for p in passes],
            "acceptance": [p["acceptance"] for p in passes],
        }
        for name, passes in results.items()
    }
    add_ratios(rows)
    return {"requests": len(bodies_), "repeats": repeats, "rows": rows}


def _report_line(name: str, passes: list[dict]) -> None:
    rates = ", ".join(f"{p['tokens_per_s']:.1f}" for p in passes)
    taken = [p["acceptance"] for p in passes if p["acceptance"] is not None]
    accepted = f", drafts accepted {statistics.mean(taken):.2f}" if taken else ""
    print(f"  {name:<16} tok/s per pass: {rates}{accepted}", flush=True)


def to_markdown(report: dict) -> str:
    lines = [
        "| server | tok/s (median) | / specd off | / llama-server |",
        "| --- | --- | --- | --- |",
    ]
    for name, row in report["rows"].items():
        cells = ratio_cells(row)
        lines.append(f"| {name} | {row['tokens_per_s']:.1f} | {cells} |")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specd bench infill", description=__doc__.split("\n")[0])
    add_flags(p, "off,auto", "specd's speculation modes")
    p.add_argument("--workload", default="fim", help="FIM prompts (%(default)s)")
    p.add_argument("--n-predict", type=int, default=64, help="tokens at most (%(default)s)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return http_peers.main(args, bodies(args.workload, args.n_predict), run, to_markdown)


if __name__ == "__main__":
    raise SystemExit(main())
