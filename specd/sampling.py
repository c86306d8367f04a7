"""Greedy verification and exact rejection sampling (the target's and the drafter's
probabilities come from specd/logits.py).

Pure functions (on tensors; greedy_round on lists); randomness comes in as tensors
(`uniforms`, `noise`) so the batched sampler and the slow reference in the tests can be
fed the same draws (specd/draws.py makes them from each request's seeded
`torch.Generator`).

Terms (one speculation round of one sequence, k >= 0 draft tokens):
  draft tokens   d_1..d_k, proposed by a drafter from its distributions q_1..q_k
  draft probs    q_j: dense [V], sparse (ids, probs of a top-m truncation) or absent
                 (a deterministic drafter: q_j is one-hot at d_j)
  target probs   p_1..p_{k+1}: the target's distributions after the request's transforms,
                 p_j conditioned on the context plus d_1..d_{j-1}
  accepted       d_j is accepted when u_j < p_j(d_j) / q_j(d_j), u_j ~ U(0, 1), for as long
                 as every earlier draft was accepted; a = number accepted (0..k)
  recovered      at the first rejection (a < k) one token from norm(max(0, p_{a+1} - q_{a+1}))
  bonus          when all k are accepted, one token from p_{k+1}
Each round emits a + 1 tokens: d_1..d_a and the recovered or bonus token. This is exact:
every emitted token is distributed as the target's p (Leviathan et al. 2023, Thm. 1), for
any q as long as q is what d was really drawn from. With temperature 0 the same round is
greedy verification: accept while d_j == argmax p_j, then emit argmax p_{a+1}.

Alternatives make the round a tree (one forward verifies them, see
verifier_service/tree.py): (parent, token) pairs, each a sibling of chain draft
d_{parent+1}, so a leaf hanging off node `parent` (0 is the root). A chain is the tree
without alternatives: the same functions verify both. Where the chain stops at node a,
the alternatives hanging there are tested in order against what is left, as deterministic
proposals (iterative speculative sampling over a token tree, as in SpecInfer, Miao et al.
2023, and Sequoia, Chen et al. 2024):
  sampled   w = the residual max(0, p_{a+1} - q_{a+1}); alternative x is accepted with
            probability w(x) / sum(w), else x is removed from w; the first accepted is
            emitted followed by a bonus token from p at its node; if none is, a token
            from norm(w) is emitted.
  greedy    the first alternative equal to argmax p_{a+1} is taken, then argmax p at it.
This stays exact whatever chose the alternatives: once the children before it are
rejected the node's residual no longer depends on which tokens they were, and testing a
fixed token x against it (accept with probability w(x), else sample w without x) emits
exactly norm(w). A duplicate of a rejected child is always rejected (rejecting x leaves
no residual mass at x).

Batched shapes: N sequences, K = max k (shorter rows padded), A = max alternatives, V
vocabulary. Target rows per sequence: R = K + 1 + A, the chain's nodes 0..K then the
alternatives' nodes (row K + 1 + j for alternative j).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Verified(NamedTuple):
    tokens: torch.Tensor  # [N, K+1] emitted, padded with -1
    accepted: torch.Tensor  # [N] drafts accepted, the alternative taken included
    alternative: torch.Tensor  # [N] index of the alternative taken, -1 for none


class Alternatives(NamedTuple):
    tokens: torch.Tensor  # [N, A] long (padding: any token)
    parents: torch.Tensor  # [N, A] long: chain node each hangs off (padding: -1)
    uniforms: torch.Tensor  # [N, A] U(0, 1) draws

    @staticmethod
    def none(n: int) -> Alternatives:
        empty = torch.zeros(n, 0, dtype=torch.long)
        return Alternatives(empty, empty, torch.zeros(n, 0))


def _num_accepted(accept: torch.Tensor, num_draft: torch.Tensor) -> torch.Tensor:
    """accept bool [N, K] -> leading run of accepted drafts within each row's k, [N]."""
    k_max = accept.shape[1]
    valid = torch.arange(k_max)[None, :] < num_draft[:, None]
    return (accept & valid).int().cumprod(dim=1).sum(dim=1)


def greedy_round(
    argmax: list[int], drafts: list[int], alts: list[tuple[int, int]] = ()
) -> tuple[list[int], int, int]:
    """One sequence's greedy round on plain lists: argmax p at its nodes (the chain's
    0..k, then alternative j's at k + 1 + j), its k drafts, its (parent, token)
    alternatives -> (the emitted tokens, the drafts accepted with the alternative taken,
    that alternative or -1). Per sequence on lists: the batched tensor ops it replaces
    took ~0.5 ms a step at c = 1, for what is a few comparisons (docs/benchmarks-log.md
    section 50)."""
    k, a = len(drafts), 0
    while a < k and drafts[a] == argmax[a]:
        a += 1
    want = argmax[a]  # the target's token at node a
    for j, (parent, token) in enumerate(alts):
        if parent == a and token == want:  # then the target's token at that leaf
            return [*drafts[:a], token, argmax[k + 1 + j]], a + 1, j
    return [*drafts[:a], want], a, -1


def rejection_sample(
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    num_draft: torch.Tensor,
    uniforms: torch.Tensor,
    noise: torch.Tensor,
    alts: Alternatives | None = None,
) -> Verified:
    """Exact speculative sampling for a batch of sequences with different k.

    target_probs [N, R, V]    p at every node: p_1..p_{K+1}, then the alternatives'
    draft_tokens [N, K]       d_1..d_K (positions >= num_draft[i] are padding)
    draft_probs  [N, K, V]    dense q (see sparse_to_dense / onehot_probs)
    num_draft    [N]          k_i
    uniforms     [N, K]       u_j ~ U(0, 1)
    noise        [N, V]       Exp(1) draws; argmax(w / noise) samples from weights w
    alts                      alternatives with their own uniforms, or None
    """
    n, k_max = draft_tokens.shape
    alts = alts if alts is not None else Alternatives.none(n)
    rows = torch.arange(n)
    p_d = target_probs[:, :k_max].gather(-1, draft_tokens[..., None])[..., 0]  # [N, K]
    q_d = draft_probs.gather(-1, draft_tokens[..., None])[..., 0]  # [N, K]
    a = _num_accepted(uniforms * q_d < p_d, num_draft)  # u < p/q without dividing by q

    p_next = target_probs[rows, a]  # [N, V] the distribution after the accepted run
    residual = p_next
    if k_max > 0:
        q_next = draft_probs[rows, a.clamp(max=k_max - 1)]
        q_next = torch.where((a < num_draft)[:, None], q_next, 0.0)  # bonus: no q
        residual = _residual(p_next, q_next)
    taken = _take_alternative(residual, alts, a)
    final = residual
    if alts.tokens.shape[1]:
        bonus = target_probs[rows, k_max + 1 + taken.clamp(min=0)]  # p at the alternative taken
        final = torch.where((taken >= 0)[:, None], bonus, residual)
    extra = (final / noise).argmax(-1)  # [N], a sample from norm(final)
    return _verified(draft_tokens, a, extra, alts, taken)


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Where a draft was rejected the next token comes from norm(max(0, p - q))
    (unnormalised here). p == q (numerically) leaves no mass; then rejection had
    probability 0 and p stands."""
    residual = (p - q).clamp(min=0.0)
    empty = residual.sum(-1, keepdim=True) <= 0
    return torch.where(empty, p, residual)


def _take_alternative(residual: torch.Tensor, alts: Alternatives, a: torch.Tensor):
    """Try the alternatives hanging where the chain stopped, in order, each as a draft
    of the deterministic proposer from the residual: accepted with probability
    w(x) / sum(w); a rejected one's mass leaves the residual (in place). -> [N] index of
    the alternative taken, -1 for none."""
    n = residual.shape[0]
    rows = torch.arange(n)
    taken = torch.full((n,), -1, dtype=torch.long)
    for j in range(alts.tokens.shape[1]):
        x = alts.tokens[:, j]
        active = (alts.parents[:, j] == a) & (taken < 0)
        total, w_x = residual.sum(-1), residual[rows, x]
        accept = active & (alts.uniforms[:, j] * total < w_x)  # u < w(x) / sum(w)
        taken = torch.where(accept, j, taken)
        drop = active & ~accept & (total - w_x > 0)  # else the rejection had probability 0
        residual[rows[drop], x[drop]] = 0.0
    return taken


def _verified(draft_tokens, a, extra, alts: Alternatives, taken) -> Verified:
    """Emitted: d_1..d_a, then the alternative taken (if any), then `extra`."""
    n, k_max = draft_tokens.shape
    rows = torch.arange(n)
    pos = torch.arange(k_max + 1)[None, :]
    padded = torch.cat([draft_tokens, torch.full((n, 1), -1, dtype=torch.long)], dim=1)
    out = torch.where(pos < a[:, None], padded, torch.full_like(padded, -1))
    has = taken >= 0
    if alts.tokens.shape[1]:
        alt_token = alts.tokens[rows, taken.clamp(min=0)]
        out = out.scatter(1, a[:, None], torch.where(has, alt_token, extra)[:, None])
    else:
        out = out.scatter(1, a[:, None], extra[:, None])
    # after an alternative (a < k there, so a + 1 <= K fits), its bonus token
    out[rows[has], a[has] + 1] = extra[has]
    return Verified(out, a + has.long(), taken)
