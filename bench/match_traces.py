"""`specd bench matches`: where the draft model's greedy token is the target's, token by
token, on every workload prompt, for `specd bench controller --workload` to replay.

    specd bench matches [--tokens 64] [--out bench/workloads/matches.json]

For each prompt of bench/workloads the target greedy-decodes up to `--tokens` tokens (to
its end-of-sequence token, kept), and the drafter, as `specd serve drafter` loads it by
default (int4 where the target is, its trimmed head), reads the prompt and that output in
one forward: position t is a match where its argmax after output[:t] is output[t]. Greedy
speculation accepts exactly those drafts, so a round of k drafts started at t accepts the
run of matches from t, up to k: the texts' real acceptance, in order, position by
position (the controller's estimates follow streaks, which no average shows). Beside each
position goes the drafter's probability of its argmax there (two decimals), where a round
with `p_min` stops (DrafterConfig.p_min; past a mismatch the drafter really sees its own
draft, not the target's token, so a replay's stops there are approximate, and only its
costs depend on them).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench import flags
from bench.prompts import WORKLOADS, load_workload

DEFAULT_OUT = WORKLOADS / "matches.json"


def matches(draft, prompt: list[int], output: list[int]) -> tuple[list[int], list[float]]:
    """1 where the drafter's argmax after prompt + output[:t] is output[t], and the
    drafter's probability of that argmax."""
    from specd.models.paged_kv import PagedKV
    from specd.models.seq_input import SeqInput

    kv = PagedKV.for_model(draft, num_blocks=-(-(len(prompt) + len(output)) // 16))
    kv.allocator.allocate(0)
    fed = prompt + output[:-1]
    logits = draft.forward(kv, [SeqInput(0, fed, num_logits=len(output))])
    top, cols = logits.float().softmax(-1).max(-1)
    ids = cols if draft.head_ids is None else draft.head_ids[cols]
    hits = [int(a == b) for a, b in zip(ids.tolist(), output, strict=True)]
    return hits, [round(p, 2) for p in top.tolist()]


def record(target_spec: str, draft_spec: str, tokens: int) -> dict:
    from bench.quality import greedy
    from drafter_service.draft_model import load_draft_model
    from specd.config import DrafterConfig
    from specd.models.loader import eos_token_ids, load_config, load_model, load_tokenizer
    from specd.models.resolve import resolve

    folder = resolve(target_spec)
    tokenizer, stops = load_tokenizer(folder), eos_token_ids(folder, load_config(folder))
    target = load_model(folder, weights="auto")
    cfg = DrafterConfig()
    draft = load_draft_model(draft_spec, weights=cfg.weights, vocab=cfg.vocab)
    workloads, confidence = {}, {}
    for path in sorted(WORKLOADS.glob("*.jsonl")):
        prompts = load_workload(path.stem, tokenizer)
        outputs = [greedy(target, p, tokens, stops) for p in prompts]
        texts = [matches(draft, p, o) for p, o in zip(prompts, outputs, strict=True)]
        workloads[path.stem] = [hits for hits, _ in texts]
        confidence[path.stem] = [top for _, top in texts]
    return {
        "target": target_spec,
        "draft": draft_spec,
        "tokens": tokens,
        "workloads": workloads,
        "confidence": confidence,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specd bench matches", description=__doc__.split("\n")[0])
    p.add_argument("--target", default="default-target", help=f"the target: {flags.MODEL}")
    p.add_argument("--draft", default="default-draft", help=f"the draft model: {flags.MODEL}")
    p.add_argument("--tokens", type=int, default=64, help=flags.MAX_NEW_TOKENS)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the traces (%(default)s)")
    args = p.parse_args(argv)
    traces = record(args.target, args.draft, args.tokens)
    args.out.write_text(json.dumps(traces, separators=(",", ":")) + "\n")
    for name, rows in traces["workloads"].items():
        hits = sum(map(sum, rows)) / max(1, sum(map(len, rows)))
        print(f"{name}: {len(rows)} prompts, {hits:.3f} of positions match")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
