"""The random draws a verification round consumes, made from each request's own seeded
`torch.Generator` so that a request's output depends only on its seed and its history
(specd/sampling.py takes them as plain tensors)."""

from __future__ import annotations

import torch


def make_generator(seed: int | None) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, (1,)).item()))
    return g


def draw_randomness(
    generators: list[torch.Generator], ks: list[int], vocab: int, alts: list[int] | None = None
):
    """Per-sequence draws from each request's own generator -> (uniforms [N, K], noise
    [N, V], alternative uniforms [N, A]). Sequence i draws exactly k_i uniforms, V
    exponentials and then alts[i] uniforms, so a request's draws depend only on its seed
    and its own history, never on the rest of the batch."""
    alts = alts if alts is not None else [0] * len(ks)
    k_max, a_max = max(ks, default=0), max(alts, default=0)
    uniforms = torch.ones(len(generators), k_max)
    for i, (g, k) in enumerate(zip(generators, ks, strict=True)):
        uniforms[i, :k] = torch.rand(k, generator=g)
    noise = torch.stack([torch.empty(vocab).exponential_(generator=g) for g in generators])
    alt_uniforms = torch.ones(len(generators), a_max)
    for i, (g, m) in enumerate(zip(generators, alts, strict=True)):
        alt_uniforms[i, :m] = torch.rand(m, generator=g)
    return uniforms, noise, alt_uniforms
