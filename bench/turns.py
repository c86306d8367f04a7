"""`specd bench turns`: multi-turn chats through the HTTP door, and what the replicas'
prefix caches saved them.

    specd bench turns --http http://127.0.0.1:8000 [--conversations 6] [--turns 3]
                      [--max-tokens 32] [--label NAME] [--json FILE]

Each conversation opens with one of the workload's chats (`agentic` by default: long
files to edit); each later turn sends the whole conversation again, the model's answer
and a follow-up request appended, as chat clients do. Turn by turn, every conversation
sends its next request, one at a time, in a shuffled order (seeded), greedy and streamed.
Reported per turn: the time to the first token (median, mean, max) and the share of the
prompt's tokens a replica's prefix cache held (the usage's
`prompt_tokens_details.cached_tokens`). Run it against a freshly started router and
replicas (a warm cache holds every turn), with and without `--no-prefix-affinity` (label
each run), to see what sending a conversation back to the replica that holds it is worth.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
import urllib.request
from pathlib import Path

from bench.prompts import load_items

FOLLOW_UPS = [
    "Now add type hints where they are missing, and show the whole result again.",
    "Explain in two sentences what you changed and why.",
    "Write one unit test for the main function.",
    "Make it shorter without changing what it does.",
]


def ask(url: str, model: str, messages: list[dict], max_tokens: int) -> dict:
    """One streamed greedy chat: its text, time to the first token and usage."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    request = urllib.request.Request(
        f"{url}/v1/chat/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    start, first, text, usage = time.perf_counter(), None, [], None
    with urllib.request.urlopen(request, timeout=900) as stream:
        for line in stream:
            data = line.decode().strip().removeprefix("data: ")
            if not data or data == "[DONE]":
                continue
            chunk = json.loads(data)
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                delta = choice["delta"].get("content") or ""
                if delta and first is None:
                    first = time.perf_counter()
                text.append(delta)
    return {"text": "".join(text), "ttft": (first or time.perf_counter()) - start, "usage": usage}


def run(url: str, model: str, workload: str, conversations: int, turns: int, max_tokens: int):
    chats = [item["messages"] for item in load_items(workload)[:conversations]]
    order = random.Random(0)
    rows = []
    for turn in range(turns):
        waves = list(range(len(chats)))
        order.shuffle(waves)
        for c in waves:
            answer = ask(url, model, chats[c], max_tokens)
            usage = answer["usage"]
            cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
            rows.append(
                {"turn": turn + 1, "conversation": c, "ttft": answer["ttft"],
                 "prompt_tokens": usage["prompt_tokens"], "cached_tokens": cached}
            )  # fmt: skip
            follow = FOLLOW_UPS[(turn + c) % len(FOLLOW_UPS)]
            chats[c] = chats[c] + [
                {"role": "assistant", "content": answer["text"]},
                {"role": "user", "content": follow},
            ]
    return rows


def summary(rows: list[dict]) -> list[dict]:
    out = []
    for turn in sorted({r["turn"] for r in rows}):
        of = [r for r in rows if r["turn"] == turn]
        prompt = sum(r["prompt_tokens"] for r in of)
        out.append(
            {
                "turn": turn,
                "requests": len(of),
                "ttft_median_s": statistics.median(r["ttft"] for r in of),
                "ttft_mean_s": statistics.mean(r["ttft"] for r in of),
                "ttft_max_s": max(r["ttft"] for r in of),
                "prompt_tokens": prompt,
                "cached_share": sum(r["cached_tokens"] for r in of) / prompt if prompt else 0.0,
            }
        )
    return out


def to_markdown(label: str, turns: list[dict]) -> str:
    lines = [
        f"| {label}: turn | requests | TTFT median / mean / max (s) | prompt tokens | cached |",
        "| --- | --- | --- | --- | --- |",
    ]
    for t in turns:
        ttft = f"{t['ttft_median_s']:.2f} / {t['ttft_mean_s']:.2f} / {t['ttft_max_s']:.2f}"
        lines.append(
            f"| {t['turn']} | {t['requests']} | {ttft} | {t['prompt_tokens']} "
            f"| {100 * t['cached_share']:.0f}% |"
        )
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specd bench turns", description=__doc__.split("\n")[0])
    p.add_argument("--http", required=True, help="specd's HTTP door, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="(%(default)s)")
    p.add_argument("--workload", default="agentic", help="opening chats (%(default)s)")
    p.add_argument("--conversations", type=int, default=6, help="(%(default)s)")
    p.add_argument("--turns", type=int, default=3, help="requests each (%(default)s)")
    p.add_argument("--max-tokens", type=int, default=32, help="per answer (%(default)s)")
    p.add_argument("--label", default="specd", help="names the run in the report (%(default)s)")
    p.add_argument("--json", help="also write the report here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    rows = run(
        args.http.rstrip("/"),
        args.model,
        args.workload,
        args.conversations,
        args.turns,
        args.max_tokens,
    )
    turns = summary(rows)
    print(to_markdown(args.label, turns))
    if args.json:
        report = {"label": args.label, "turns": turns, "requests": rows}
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
