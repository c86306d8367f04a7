"""What the benches that send the same bodies to specd's HTTP door and to llama-server
share (bench/infill.py, bench/predict.py): their flags, and each row's speed as a ratio
to specd `off` and to llama-server plain, measured in the same run."""

from __future__ import annotations

import argparse
import json
import urllib.request
from pathlib import Path

BASES = ("specd off", "llamacpp")  # the rows the others are put beside


def post(url: str, path: str, body: dict) -> dict:
    """One JSON request to a server's `path` (`/infill`, `/v1/chat/completions`)."""
    req = urllib.request.Request(
        f"{url}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=900) as r:
        return json.loads(r.read())


def add_flags(p: argparse.ArgumentParser, modes: str, modes_help: str) -> None:
    """--http, --modes, --peer, --model, --draft-model, --repeats and --json."""
    p.add_argument("--http", required=True, help="specd's HTTP door, e.g. http://127.0.0.1:8000")
    p.add_argument("--modes", default=modes, help=f"{modes_help} (%(default)s)")
    p.add_argument(
        "--peer",
        default="llamacpp,llamacpp-draft",
        help="llama-server variants, '' for none (%(default)s)",
    )
    p.add_argument("--model", default="default-target", help="the peers' target (%(default)s)")
    p.add_argument("--draft-model", default="default-draft", help="their draft (%(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="timed passes each (%(default)s)")
    p.add_argument("--json", help="also write the report here")


def add_ratios(rows: dict[str, dict]) -> None:
    """Each row's `over BASE`: its tokens_per_s over each base row's, where it ran."""
    for base in BASES:
        if base in rows:
            for row in rows.values():
                row[f"over {base}"] = row["tokens_per_s"] / rows[base]["tokens_per_s"]


def ratio_cells(row: dict) -> str:
    """The row's ratios as table cells ('-' where its base did not run)."""
    ratios = [row.get(f"over {base}") for base in BASES]
    return " | ".join("-" if r is None else f"{r:.2f}x" for r in ratios)


def main(args, asked: list, run, to_markdown) -> int:
    """Run the bench as its flags say, on `asked` (its bodies), print its table and keep
    its report where --json says."""
    report = run(
        args.http.rstrip("/"),
        [p for p in args.peer.split(",") if p],
        [m for m in args.modes.split(",") if m],
        asked,
        args.repeats,
        args.model,
        args.draft_model,
    )
    print(to_markdown(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0
