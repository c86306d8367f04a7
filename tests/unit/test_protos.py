"""The committed generated code matches the .proto files (`make protos` regenerates)."""

import re
from pathlib import Path

from protos.generate import PROTO_DIR, ROOT, generate


def test_generated_code_is_up_to_date(tmp_path):
    generate(tmp_path)
    fresh = sorted((tmp_path / PROTO_DIR).glob("*_pb2*.py*"))
    assert fresh, "protoc produced nothing"
    for f in fresh:
        committed = ROOT / PROTO_DIR / f.name
        assert committed.exists(), f"{f.name} is not committed; run `make protos`"
        assert committed.read_text() == f.read_text(), f"{f.name} drifted; run `make protos`"
    committed_names = {p.name for p in (ROOT / PROTO_DIR).glob("*_pb2*.py*")}
    assert committed_names == {f.name for f in fresh}


def test_every_field_is_commented():
    field = re.compile(r"^\s*(optional |repeated )?[\w.<>, ]+ \w+ = \d+;")
    for proto in (ROOT / PROTO_DIR).glob("*.proto"):
        lines = Path(proto).read_text().splitlines()
        for i, line in enumerate(lines):
            if field.match(line):
                documented = lines[i - 1].strip().startswith("//") or "//" in line
                assert documented, f"{proto.name}:{i + 1} has no comment: {line.strip()}"
