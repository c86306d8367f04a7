"""The random draws a verification round consumes, made from each request's own seeded
`torch.Generator` so that a request's output depends only on its seed and its history
(specd/sampling.py takes them as plain tensors); and a seeded request's draws at each
position of its output, the same however its rounds were drafted (position_noise)."""

from __future__ import annotations

import numpy as np
import torch


def make_generator(seed: int | None) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, (1,)).item()))
    return g


def position_noise(seed: int, position: int, size: int) -> torch.Tensor:
    """Exp(1) draws E [size] for output position `position` (the index its token will
    have in the sequence) of a request seeded with `seed`: its token is argmax p(x) / E(x),
    a sample from p (the exponential race, the Gumbel-max trick), and the same at that
    position whatever was drafted, so a seeded request's output is the same with
    speculation on, off or auto. Drawn by PCG64 keyed by (seed, position), so that the
    first n draws are the same for any size >= n (a drafter with a smaller vocabulary
    draws the same at its ids). ~0.6 ms for 152k tokens."""
    g = np.random.Generator(np.random.PCG64([seed & (2**64 - 1), position]))
    return torch.from_numpy(g.standard_exponential(size, dtype=np.float32))


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
