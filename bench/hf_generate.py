"""transformers' `generate` on the same prompts (plain, assisted by the draft model, prompt
lookup): the peer of `specd bench spec` and `sweep --peer hf`, and where two runs' greedy
outputs first differ."""

from __future__ import annotations

import time

import torch


def run_hf(folder, draft_folder, prompts, max_new: int, dtype) -> dict:
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    draft = AutoModelForCausalLM.from_pretrained(draft_folder, dtype=dtype)
    modes = {
        "hf:plain": {},
        "hf:assisted": {"assistant_model": draft},
        "hf:prompt-lookup": {"prompt_lookup_num_tokens": 10},
    }
    results = {}
    for name, extra in modes.items():
        tokens, seconds, outputs = 0, 0.0, []
        for ids in prompts:
            x = torch.tensor([ids])
            t0 = time.perf_counter()
            out = target.generate(x, do_sample=False, max_new_tokens=max_new, **extra)
            seconds += time.perf_counter() - t0
            gen = out[0, len(ids) :].tolist()
            tokens += len(gen)
            outputs.append(gen)
        results[name] = {
            "tokens": tokens,
            "seconds": round(seconds, 3),
            "tok_per_s": tokens / seconds,
            "outputs": outputs,
        }
    return results


def first_divergence(a: list[list[int]], b: list[list[int]]) -> list[int | None]:
    out = []
    for x, y in zip(a, b, strict=True):
        out.append(
            next(
                (i for i, (s, t) in enumerate(zip(x, y, strict=False)) if s != t),
                None if len(x) == len(y) else min(len(x), len(y)),
            )
        )
    return out
