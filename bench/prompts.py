"""The benchmark workloads (bench/workloads/*.jsonl, shipped as package data): prompts as
items, token ids or chat conversations. No torch here: the clients import it too."""

from __future__ import annotations

import json
from pathlib import Path

WORKLOADS = Path(__file__).parent / "workloads"
# every prompt's first tokens, run by every mode before a sweep's cells: enough for a
# drafting mode to draft, so its drafter has seen the prompt (bench/sweep.py, the peers)
WARM_UP_TOKENS = 8


def load_items(workload: str) -> list[dict]:
    """A workload's requests: a shipped name (`code`, `chat`, ...) or a JSONL file."""
    path = Path(workload) if Path(workload).exists() else WORKLOADS / f"{workload}.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def load_workload(name: str, tokenizer, limit: int | None = None) -> list[list[int]]:
    prompts = []
    for item in load_items(name):
        if "messages" in item:
            enc = tokenizer.apply_chat_template(
                item["messages"], add_generation_prompt=True, tokenize=True
            )
            ids = enc["input_ids"] if hasattr(enc, "keys") else enc
        else:
            ids = tokenizer(item["prompt"])["input_ids"]
        prompts.append(list(ids))
    return prompts[:limit] if limit else prompts


def load_requests(workload: str) -> list[list[dict] | str]:
    """A workload's requests as a sweep sends them: a chat's messages, or a raw prompt's
    text (no chat template: e.g. the `fim` workload's fill-in-the-middle prompts)."""
    return [it["messages"] if "messages" in it else it["prompt"] for it in load_items(workload)]


def load_conversations(workload: str) -> list[list[dict]]:
    return [
        it["messages"] if "messages" in it else [{"role": "user", "content": it["prompt"]}]
        for it in load_items(workload)
    ]
