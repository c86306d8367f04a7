"""Logits -> probabilities, greedy verification and exact rejection sampling.

Pure tensor functions; randomness comes in as tensors (`uniforms`, `noise`) so the batched
sampler and the slow reference in the tests can be fed the same draws. `draw_randomness`
makes those tensors from per-request seeded `torch.Generator`s.

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

Batched shapes: N sequences, K = max k (shorter rows padded), V vocabulary.
"""

from __future__ import annotations

import torch

from specd.params import SamplingParams


# -- the request's transforms (shared by drafter and verifier) ----------------------------
def presence_rows(context: list[int], drafts: list[int], vocab: int) -> torch.Tensor:
    """Tokens seen before each of the k+1 rows of a round -> bool [k+1, V]: row j has the
    context plus d_1..d_j (row 0 the context only)."""
    return presence_of_paths(context, [drafts[:j] for j in range(len(drafts) + 1)], vocab)


def presence_of_paths(context: list[int], paths: list[list[int]], vocab: int) -> torch.Tensor:
    """The same for any rows (a tree's nodes): row n has the context plus paths[n]."""
    rows = torch.zeros(len(paths), vocab, dtype=torch.bool)
    if context:
        rows[:, torch.tensor(context)] = True
    for n, path in enumerate(paths):
        if path:
            rows[n, torch.tensor(path)] = True
    return rows


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float):
    """logits [R, V], seen bool [R, V] (built on the CPU) -> logits with seen tokens
    penalised, on the logits' device."""
    if penalty == 1.0:
        return logits
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen.to(logits.device), penalised, logits)


def logits_to_probs(
    logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None = None
) -> torch.Tensor:
    """logits [R, V] (fp32) -> probs [R, V] after repetition penalty, temperature, top-k,
    top-p and min-p, in that order (as transformers). Greedy params give one-hot argmax."""
    if seen is not None:
        logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[:, -1:]  # [R, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # drop a token when the mass before it already reaches top_p (keeps at least one)
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        probs = probs.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), 0.0)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(-1, keepdim=True).values, 0)
    return probs / probs.sum(-1, keepdim=True)


# -- proposals -> dense q -----------------------------------------------------------------
def sparse_to_dense(ids: torch.Tensor, probs: torch.Tensor, vocab: int) -> torch.Tensor:
    """Sparse q: ids, probs [..., m] -> dense [..., V] (zero off the support). Adds, so
    zero-probability padding entries may repeat an id without clobbering it."""
    dense = torch.zeros(*ids.shape[:-1], vocab, dtype=probs.dtype)
    return dense.scatter_add_(-1, ids, probs)


def onehot_probs(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """Absent q (deterministic drafter): one-hot at each draft token, [..., V]."""
    return torch.nn.functional.one_hot(tokens, vocab).float()


# -- verification ---------------------------------------------------------------------------
def _num_accepted(accept: torch.Tensor, num_draft: torch.Tensor) -> torch.Tensor:
    """accept bool [N, K] -> leading run of accepted drafts within each row's k, [N]."""
    k_max = accept.shape[1]
    valid = torch.arange(k_max)[None, :] < num_draft[:, None]
    return (accept & valid).int().cumprod(dim=1).sum(dim=1)


def greedy_verify(
    target_argmax: torch.Tensor, draft_tokens: torch.Tensor, num_draft: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """target_argmax [N, K+1], draft_tokens [N, K], num_draft [N]
    -> (tokens [N, K+1] emitted, padded with -1; num_accepted [N])."""
    n, k_max = draft_tokens.shape
    a = _num_accepted(draft_tokens == target_argmax[:, :k_max], num_draft)
    extra = target_argmax.gather(1, a[:, None])  # [N, 1] correction or bonus
    return _emitted(draft_tokens, a, extra[:, 0]), a


def rejection_sample(
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    num_draft: torch.Tensor,
    uniforms: torch.Tensor,
    noise: torch.Tensor,
):
    """Exact speculative sampling for a batch of sequences with different k.

    target_probs [N, K+1, V]  p_1..p_{K+1}
    draft_tokens [N, K]       d_1..d_K (positions >= num_draft[i] are padding)
    draft_probs  [N, K, V]    dense q (see sparse_to_dense / onehot_probs)
    num_draft    [N]          k_i
    uniforms     [N, K]       u_j ~ U(0, 1)
    noise        [N, V]       Exp(1) draws; argmax(w / noise) samples from weights w
    -> (tokens [N, K+1] emitted, padded with -1; num_accepted [N])
    """
    n, k_max = draft_tokens.shape
    rows = torch.arange(n)
    p_d = target_probs[:, :k_max].gather(-1, draft_tokens[..., None])[..., 0]  # [N, K]
    q_d = draft_probs.gather(-1, draft_tokens[..., None])[..., 0]  # [N, K]
    a = _num_accepted(uniforms * q_d < p_d, num_draft)  # u < p/q without dividing by q

    p_next = target_probs[rows, a]  # [N, V] the distribution after the accepted run
    if k_max > 0:
        q_next = draft_probs[rows, a.clamp(max=k_max - 1)]
        q_next = torch.where((a < num_draft)[:, None], q_next, 0.0)  # bonus: no q
        residual = (p_next - q_next).clamp(min=0.0)  # recovered: norm(max(0, p - q))
        # p == q (numerically) leaves no residual mass; then rejection had probability 0
        empty = residual.sum(-1, keepdim=True) <= 0
        residual = torch.where(empty, p_next, residual)
    else:
        residual = p_next
    extra = (residual / noise).argmax(-1)  # [N], a sample from norm(residual)
    return _emitted(draft_tokens, a, extra), a


def _emitted(draft_tokens, a, extra) -> torch.Tensor:
    n, k_max = draft_tokens.shape
    pos = torch.arange(k_max + 1)[None, :]
    padded = torch.cat([draft_tokens, torch.full((n, 1), -1, dtype=torch.long)], dim=1)
    out = torch.where(pos < a[:, None], padded, torch.full_like(padded, -1))
    return out.scatter(1, a[:, None], extra[:, None])


# -- randomness -----------------------------------------------------------------------------
def make_generator(seed: int | None) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, (1,)).item()))
    return g


def draw_randomness(generators: list[torch.Generator], ks: list[int], vocab: int):
    """Per-sequence draws from each request's own generator -> (uniforms [N, K], noise [N, V]).
    Sequence i draws exactly k_i uniforms and V exponentials, so a request's draws depend
    only on its seed and its own history, never on the rest of the batch."""
    k_max = max(ks, default=0)
    uniforms = torch.ones(len(generators), k_max)
    for i, (g, k) in enumerate(zip(generators, ks, strict=True)):
        uniforms[i, :k] = torch.rand(k, generator=g)
    noise = torch.stack([torch.empty(vocab).exponential_(generator=g) for g in generators])
    return uniforms, noise
