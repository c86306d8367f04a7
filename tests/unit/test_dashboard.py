"""The Grafana dashboard only queries metrics that specd exports."""

import json
import re
from pathlib import Path

from specd import telemetry

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "specd.json"


def test_dashboard_queries_known_metrics():
    dash = json.loads(DASHBOARD.read_text())
    names = {
        v
        for k, v in vars(telemetry).items()
        if k.isupper() and isinstance(v, str) and v.startswith("specd:")
    }
    exported = set()
    for n in names:  # what the Prometheus exporter makes of them
        exported |= {n, f"{n}_total", f"{n}_bucket", f"{n}_count", f"{n}_sum"}
    used = set()
    for panel in dash["panels"]:
        for target in panel["targets"]:
            used |= set(re.findall(r"specd:[a-z_]+", target["expr"]))
    assert used, "the dashboard queries nothing"
    assert used <= exported, f"unknown metrics: {sorted(used - exported)}"
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    for topic in (
        "acceptance rate by route",
        "position",
        "reason",
        "tpot",
        "kv",
        "fallbacks",
        "phases",
    ):
        assert topic in titles
