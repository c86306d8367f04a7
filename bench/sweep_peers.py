"""`specd bench sweep --peer`: transformers' generate or llama-server on the same prompts,
and each specd cell's ratio to them."""

from __future__ import annotations

import tempfile


def hf_peer(model: str, draft_model: str, conversations, max_new: int, dtype_name: str) -> dict:
    """transformers' generate on the same pair and prompts (concurrency 1, greedy, bf16
    where the CPU has it, like the services)."""
    import torch

    from bench.hf_generate import run_hf
    from specd.models.args import parse_dtype
    from specd.models.loader import load_tokenizer
    from specd.models.resolve import resolve

    folder, draft = resolve(model), resolve(draft_model)
    tok = load_tokenizer(folder)
    prompts = []
    for messages in conversations:
        if isinstance(messages, str):  # a raw prompt
            prompts.append(tok(messages)["input_ids"])  # as the router tokenizes it
            continue
        enc = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        prompts.append(list(enc["input_ids"] if hasattr(enc, "keys") else enc))
    dtype = parse_dtype(dtype_name, torch.device("cpu"))
    results = run_hf(folder, draft, prompts, max_new, dtype)
    return {name: {k: v for k, v in r.items() if k != "outputs"} for name, r in results.items()}


def peer_ratios(report: dict) -> list[str]:
    """Each mode's concurrency-1 tokens/s over each transformers mode's."""
    lines = []
    for cell in (c for c in report["cells"] if c["concurrency"] == 1):
        for name, peer in report["peer"].items():
            ratio = cell["tokens_per_s"] / peer["tok_per_s"]
            lines.append(f"specd {cell['mode']} (c=1) / {name}: {ratio:.2f}x")
    return lines


def llamacpp_ratios(report: dict) -> list[str]:
    """Each specd cell's tokens/s over each llama-server variant's at the same concurrency
    (measured in the same run)."""
    lines = []
    for name, cells in report["llamacpp"].items():
        if isinstance(cells, dict):
            lines.append(f"{name}: {cells['error']}")
            continue
        peer = {c["concurrency"]: c["tokens_per_s"] for c in cells}
        for cell in report["cells"]:
            if cell["concurrency"] in peer:
                ratio = cell["tokens_per_s"] / peer[cell["concurrency"]]
                lines.append(
                    f"specd {cell['mode']} (c={cell['concurrency']}, "
                    f"{cell['tokens_per_s']:.1f} tok/s) / {name} "
                    f"({peer[cell['concurrency']]:.1f} tok/s): {ratio:.2f}x"
                )
    return lines


def add_peer(report: dict, args, run: dict) -> None:
    conversations = run["conversations"]
    if args.peer == "hf":
        n = min(len(conversations), args.requests_per_cell)
        report["peer"] = hf_peer(
            args.model, args.draft_model, conversations[:n], run["max_new"], args.dtype
        )
        report["peer_ratios"] = peer_ratios(report)
    if args.peer == "llamacpp":
        from bench.llamacpp import llamacpp_peer

        report["llamacpp"] = llamacpp_peer(
            args.model,
            args.draft_model,
            conversations,
            run["levels"],
            args.requests_per_cell,
            run["max_new"],
            tempfile.mkdtemp(prefix="specd-peer-"),
            [n.strip() for n in args.peer_variants.split(",")],
        )
        report["peer_ratios"] = llamacpp_ratios(report)
