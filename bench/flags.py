"""The help of flags several benches share (argparse fills in %(default)s)."""

from __future__ import annotations

from bench.prompts import WORKLOADS
from specd.config import VerifierConfig
from specd.config_flags import field_docs

MODEL = "catalogue name, Hugging Face folder or .gguf file (default: %(default)s)"
DTYPE = field_docs(VerifierConfig)["dtype"] + " (default: %(default)s)"
MAX_NEW_TOKENS = "tokens each request generates at most (default: %(default)s)"
CONCURRENCY = "concurrent clients, one cell per level, comma-separated (default: %(default)s)"


def workload(several: bool = False) -> str:
    """A --workload flag's help: the shipped workloads (or a JSONL file of one's own)."""
    names = ", ".join(sorted(p.stem for p in WORKLOADS.glob("*.jsonl")))
    what = "workloads, comma-separated" if several else "a workload"
    return f"{what}: {names}, or a JSONL file (default: %(default)s)"
