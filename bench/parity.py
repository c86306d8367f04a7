"""`specd bench parity`: is greedy output the same with speculation on and off, token for
token, through the public API in the default configuration?

    specd bench parity [--target HOST:PORT] [--workloads code,chat,edit,retrieval]
                       [--max-new-tokens 128]

Every prompt of each workload goes through the router twice, `speculation: off` then
`on`, greedy. Reports per workload how many outputs are identical and, for any that are
not, the first token where they part. Without --target it starts the services with their
default flags. Exit status 1 when any output differs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench import flags
from bench.prompts import load_conversations
from bench.sweep import add_service_args


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where a and b differ (the shorter length if one is a
    prefix of the other); None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def run(address: str, workloads: list[str], max_new: int) -> dict:
    from router.client import SpecdClient

    report = {}
    with SpecdClient(address) as client:
        for name in workloads:
            rows = []
            for messages in load_conversations(name):
                out = {
                    mode: list(
                        client.generate(
                            messages=messages, max_new_tokens=max_new, speculation=mode
                        ).token_ids
                    )
                    for mode in ("off", "on")
                }
                differs_at = first_difference(out["off"], out["on"])
                rows.append({"tokens": len(out["off"]), "differs_at": differs_at})
            same = sum(r["differs_at"] is None for r in rows)
            report[name] = {"identical": same, "prompts": len(rows), "rows": rows}
    return report


def to_markdown(report: dict) -> str:
    lines = [
        "| workload | identical on/off | first difference (token index) |",
        "| --- | --- | --- |",
    ]
    for name, r in report.items():
        diffs = [str(x["differs_at"]) for x in r["rows"] if x["differs_at"] is not None]
        lines.append(f"| {name} | {r['identical']}/{r['prompts']} | {', '.join(diffs) or '-'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specd bench parity", description=__doc__.split("\n")[0])
    add_service_args(p)
    p.add_argument("--workloads", default="code,chat,edit,retrieval", help=flags.workload(True))
    p.add_argument("--max-new-tokens", type=int, default=128, help=flags.MAX_NEW_TOKENS)
    p.add_argument("--json", help="also write the report here")
    args = p.parse_args(argv)
    workloads = args.workloads.split(",")
    if args.target:
        report = run(args.target, workloads, args.max_new_tokens)
    else:
        from launcher.processes import services_running

        with services_running(args.model, args.draft_model, args.dtype, "specd-parity-") as s:
            report = run(s["router"].address, workloads, args.max_new_tokens)
    print(to_markdown(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0 if all(r["identical"] == r["prompts"] for r in report.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
