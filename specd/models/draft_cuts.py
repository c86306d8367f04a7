"""What a draft model gives up to run faster, decided as it loads (specd.models.loader):
every matrix at 4 bits under int4, and a head that scores only its most frequent tokens.
A drafter only proposes, so what it gives up costs acceptance, never exactness: at 49,152
tokens in 4 bits the 0.5B's head is smaller than at 32,768 in 8 and agrees with the
target more often (docs/benchmarks-log.md section 41)."""

from __future__ import annotations

import torch

from specd.models.qlinear import QWeight, quantize
from specd.models.weights import fuse


def four_bit_layers(model) -> list[QWeight]:
    """Quantise a drafter's wider layer matrices again at 4 bits (round to nearest from
    their exact values): Q4_K_M keeps half the down projections in Q6_K and some value
    projections in Q8_0, ~5% of the 0.5B's bytes a forward. Parts that now share a width
    are fused into one call (q/k/v). Returns the matrices that changed; the model's
    native stack is rebuilt at its next step.

    Measured on the 0.5B against the 1.5B's greedy tokens (teacher-forced, 96 tokens of
    each workload prompt): agreement code 0.908 -> 0.909, chat 0.707 -> 0.710, retrieval
    0.848 -> 0.848 (docs/benchmarks-log.md section 49)."""
    changed = []

    def narrowed(w):
        parts = w if isinstance(w, list) else [w]
        if not all(isinstance(p, QWeight) for p in parts) or all(p.bits == 4 for p in parts):
            return w
        one = fuse([p if p.bits == 4 else quantize(p.dequantize(torch.float32), 4) for p in parts])
        changed.extend(one if isinstance(one, list) else [one])
        return one

    for layer in model.layers:
        layer.wqkv, layer.wo = narrowed(layer.wqkv), narrowed(layer.wo)
        layer.w_gate_up, layer.w_down = narrowed(layer.w_gate_up), narrowed(layer.w_down)
    if changed:
        model._stack = None
    return changed


def trim_to_vocab(model, folder, vocab: int) -> None:
    """Score only the `vocab` most frequent tokens (specd.models.vocab), at 4 bits under
    int4 (the 0.5B's head is Q8_0); nothing where `vocab` is 0 or the whole vocabulary."""
    from specd.models.vocab import load_or_build

    if 0 < vocab < model.args.vocab_size:
        keep = load_or_build(folder, vocab, model.args.vocab_size)
        bits = 4 if model.weights == "int4" else None
        model.trim_head(torch.tensor(keep, dtype=torch.long), bits)
