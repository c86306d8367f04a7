"""`specd bench parity`: is greedy output the same with speculation on and off, token for
token, through the public API in the default configuration? And seeded sampling's?

    specd bench parity [--target HOST:PORT] [--workloads code,chat,edit,retrieval]
                       [--max-new-tokens 128] [--modes off,on]
                       [--temperature 0.8 --seed 1000]

Every prompt of each workload goes through the router once per mode (`speculation: off`,
then `on`; `--modes off,on,auto` adds auto), greedy, or with `--temperature` sampled,
prompt i seeded `--seed` + i. Reports per workload how many prompts' outputs are identical
in every mode and, for any that are not, the first token where one parts from the first
mode's. Without --target it starts the services with their default flags. Exit status 1
when any output differs.
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


def run(
    address: str,
    workloads: list[str],
    max_new: int,
    modes: tuple[str, ...] = ("off", "on"),
    temperature: float = 0.0,
    seed: int = 0,
) -> dict:
    from router.client import SpecdClient

    report = {}
    with SpecdClient(address) as client:
        for name in workloads:
            rows = []
            for i, messages in enumerate(load_conversations(name)):
                sampling = {"temperature": temperature, "seed": seed + i} if temperature else {}
                out = [
                    list(
                        client.generate(
                            messages=messages, max_new_tokens=max_new, speculation=mode, **sampling
                        ).token_ids
                    )
                    for mode in modes
                ]
                parted = [first_difference(out[0], o) for o in out[1:]]
                differs_at = min((x for x in parted if x is not None), default=None)
                rows.append({"tokens": len(out[0]), "differs_at": differs_at, "output": out[0]})
            same = sum(r["differs_at"] is None for r in rows)
            report[name] = {"identical": same, "prompts": len(rows), "rows": rows}
    return report


def to_markdown(report: dict) -> str:
    lines = [
        "| workload | identical in every mode | first difference (token index) |",
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
    p.add_argument(
        "--modes",
        default="off,on",
        help="speculation modes, the first the reference (default: %(default)s)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0: greedy; else sampled, seeded (default: %(default)s)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=1000,
        help="sampled: prompt i's seed is this + i (default: %(default)s)",
    )
    p.add_argument("--json", help="also write the report here")
    args = p.parse_args(argv)
    workloads = args.workloads.split(",")
    how = (tuple(args.modes.split(",")), args.temperature, args.seed)
    if args.target:
        report = run(args.target, workloads, args.max_new_tokens, *how)
    else:
        from launcher.processes import services_running

        with services_running(args.model, args.draft_model, args.dtype, "specd-parity-") as s:
            report = run(s["router"].address, workloads, args.max_new_tokens, *how)
    print(to_markdown(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0 if all(r["identical"] == r["prompts"] for r in report.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
