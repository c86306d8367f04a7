"""Regenerate the Python code for protos/specd/v1/*.proto (`make protos`).

Run from the repository root; imports are rooted there (`protos.specd.v1.common_pb2`)
so the generated modules never shadow the `specd` package.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = Path("protos/specd/v1")


def generate(out_dir: Path) -> None:
    from grpc_tools import protoc

    protos = sorted(str(p) for p in (ROOT / PROTO_DIR).glob("*.proto"))
    rel = [str(Path(p).relative_to(ROOT)) for p in protos]
    args = [
        "protoc",
        f"-I{ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *rel,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
