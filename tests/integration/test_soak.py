"""`specd bench --soak` at 1,000 requests against real service processes (tiny models):
mixed requests -> no unexpected error, KV and drafter sessions back to 0, RSS growth < 10%."""

from __future__ import annotations

import json

import pytest

from tests.cluster import save_tiny_cluster_model
from tests.conftest import run_specd, said_logs


@pytest.mark.timeout(300)
def test_soak_small(tmp_path):
    model = save_tiny_cluster_model(tmp_path / "tiny")
    out = tmp_path / "soak.json"
    cmd = ["bench", "--soak", "--requests", "1000"]
    cmd += ["--concurrency", "8", "--model", str(model), "--draft-model", str(model)]
    cmd += ["--dtype", "float32", "--no-progress", "--json", str(out)]
    proc = run_specd(cmd, timeout=280, tmp=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    logs = said_logs(proc.stdout)
    assert [p.parent for p in logs] == [tmp_path]  # kept, under the folder it was given
    result = json.loads(out.read_text())
    assert result["ok"] and result["unexpected"] == 0
    assert result["drained"] == {
        "kv_blocks_used": 0,
        "running": 0,
        "waiting": 0,
        "drafter_sessions": 0,
    }
    assert set(result["rss"]) == {"router", "verifier", "drafter"}
    assert all(r["growth"] < 0.10 for r in result["rss"].values())
    # the mix really exercised the failure paths, not just happy requests
    kinds = {key.split("/")[0] for key in result["outcomes"]}
    assert kinds == {"plain", "stream-cancel", "deadline", "stop"}
    assert sum(n for key, n in result["outcomes"].items() if key != "plain/OK") > 30
