"""The drafter's trimmed vocabulary: the V' most frequent token ids of a model.

Frequencies come from a corpus every installation has — the Python standard library's
sources (code) and the bench workloads (chat and code prompts) — and ties and the rest are
filled in BPE merge order (a lower id was merged earlier, i.e. is more frequent). Special
tokens are always kept. Cached as JSON under $SPECD_CACHE/vocab/.
"""

from __future__ import annotations

import json
import sysconfig
from collections import Counter
from pathlib import Path

from specd.models.catalog import cache_root

CORPUS_BYTES = 4 << 20


def corpus_texts(limit_bytes: int = CORPUS_BYTES) -> list[str]:
    texts, used = [], 0
    workloads = Path(__file__).resolve().parents[2] / "bench" / "workloads"
    for f in sorted(workloads.glob("*.jsonl")):
        texts.append(f.read_text())
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for f in sorted(stdlib.glob("*.py")):
        if used >= limit_bytes:
            break
        text = f.read_text(errors="ignore")
        texts.append(text)
        used += len(text)
    return texts


def build_vocab(tokenizer, size: int, vocab_size: int) -> list[int]:
    counts: Counter[int] = Counter()
    for text in corpus_texts():
        counts.update(tokenizer(text, add_special_tokens=False)["input_ids"])
    keep = list(dict.fromkeys(tokenizer.all_special_ids))
    keep += [t for t, _ in counts.most_common() if t < vocab_size]
    keep = list(dict.fromkeys(keep))[:size]
    chosen = set(keep)
    for t in range(vocab_size):  # fill up in merge order
        if len(keep) >= size:
            break
        if t not in chosen:
            keep.append(t)
    return sorted(keep)


def vocab_path(model_name: str, size: int) -> Path:
    return cache_root() / "vocab" / f"{model_name}-{size}.json"


def load_or_build(folder: Path, size: int, vocab_size: int) -> list[int]:
    path = vocab_path(folder.name, size)
    if path.exists():
        return json.loads(path.read_text())
    from transformers import AutoTokenizer

    ids = build_vocab(AutoTokenizer.from_pretrained(folder), size, vocab_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(ids))
    return ids
