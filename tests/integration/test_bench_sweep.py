"""A small sweep against in-process tiny-model servers: well-formed JSON, Markdown, PNG."""

import json

import pytest

from bench.sweep import sweep, write_outputs
from router.policy import Policy
from tests.cluster import start_cluster


@pytest.fixture(scope="module")
def cluster(tiny_pair):
    c = start_cluster(*tiny_pair, policy=Policy.from_dict({"default": {"min_acceptance": 0}}))
    yield c
    c.close()


def test_small_sweep_writes_json_markdown_and_png(cluster, tmp_path):
    conversations = [[{"role": "user", "content": "abcabc"}], [{"role": "user", "content": "x"}]]
    modes, levels = ["off", "on", "auto"], [1, 2]
    report = sweep(
        cluster.router,
        conversations,
        modes,
        levels,
        requests=2,
        max_new=6,
        progress=lambda line: None,
    )
    paths = write_outputs(report, tmp_path)
    data = json.loads((tmp_path / "sweep.json").read_text())
    assert len(data["cells"]) == len(modes) * len(levels)
    for cell in data["cells"]:
        assert cell["requests"] >= 2 and cell["tokens"] > 0 and cell["tokens_per_s"] > 0
        assert cell["ttft_p99"] >= cell["ttft_p50"] > 0
        assert sum(cell["reasons"].values()) == cell["requests"]
    on = next(c for c in data["cells"] if c["mode"] == "on")
    off = next(c for c in data["cells"] if c["mode"] == "off")
    assert on["reasons"] == {"on": on["requests"]} and on["acceptance"] is not None
    assert off["reasons"] == {"off:client": off["requests"]} and off["acceptance"] is None
    table = (tmp_path / "sweep.md").read_text().strip().splitlines()
    assert table[0].startswith("| mode | concurrency |") and len(table) == 2 + len(data["cells"])
    pngs = [p for p in paths if p.suffix == ".png"]
    assert len(pngs) == 2
    for png in pngs:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
