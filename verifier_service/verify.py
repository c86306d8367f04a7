"""From one step's logits to the tokens each round emits (greedy or exact sampling)."""

from __future__ import annotations

import torch

from drafter_service.proposer import Proposal
from specd.sampling import (
    draw_randomness,
    greedy_verify,
    logits_to_probs,
    onehot_probs,
    presence_rows,
    rejection_sample,
    sparse_to_dense,
)


def _target_rows(seq, drafts: list[int], rows: torch.Tensor) -> torch.Tensor:
    """Target probabilities p_1..p_{k+1} after the request's own transforms."""
    seen = None
    if seq.params.repetition_penalty != 1.0:
        seen = presence_rows(seq.tokens, drafts, rows.shape[-1])
    return logits_to_probs(rows, seq.params, seen)


def _draft_q(proposal: Proposal | None, drafts: torch.Tensor, vocab: int) -> torch.Tensor:
    if proposal is None or proposal.q_ids is None:
        return onehot_probs(drafts, vocab)  # deterministic drafter
    return sparse_to_dense(proposal.q_ids, proposal.q_probs.float(), vocab)


def verify_rounds(rounds, proposals: dict, logits: torch.Tensor, vocab: int) -> dict:
    """rounds: the step's works with logits, in forward order; logits [sum(k_i + 1), V].
    -> {id(work): (emitted tokens, number of drafts accepted)}."""
    greedy, sampled, offset = [], [], 0
    for w in rounds:
        proposal = proposals.get(w.seq.seq_id)
        drafts = proposal.tokens if proposal is not None else []
        rows = logits[offset : offset + len(drafts) + 1]  # [k + 1, V]
        offset += len(drafts) + 1
        item = (w, proposal, drafts, rows)
        (greedy if w.seq.params.greedy else sampled).append(item)
    result = {}
    if greedy:
        k_max = max(len(d) for _, _, d, _ in greedy)
        argmax = torch.zeros(len(greedy), k_max + 1, dtype=torch.long)
        draft_t = torch.zeros(len(greedy), k_max, dtype=torch.long)
        for i, (w, _, drafts, rows) in enumerate(greedy):
            if w.seq.params.repetition_penalty != 1.0:
                rows = _target_rows(w.seq, drafts, rows)
            argmax[i, : len(drafts) + 1] = rows.argmax(-1)
            draft_t[i, : len(drafts)] = torch.tensor(drafts, dtype=torch.long)
        ks = torch.tensor([len(d) for _, _, d, _ in greedy])
        tokens, accepted = greedy_verify(argmax, draft_t, ks)
        result.update(_unpack(greedy, tokens, accepted))
    if sampled:
        k_max = max(len(d) for _, _, d, _ in sampled)
        n = len(sampled)
        target = torch.zeros(n, k_max + 1, vocab)
        q = torch.zeros(n, k_max, vocab)
        draft_t = torch.zeros(n, k_max, dtype=torch.long)
        for i, (w, proposal, drafts, rows) in enumerate(sampled):
            k = len(drafts)
            target[i, : k + 1] = _target_rows(w.seq, drafts, rows)
            if k:
                draft_t[i, :k] = torch.tensor(drafts, dtype=torch.long)
                q[i, :k] = _draft_q(proposal, draft_t[i, :k], vocab)
        ks = [len(d) for _, _, d, _ in sampled]
        uniforms, noise = draw_randomness([w.seq.generator for w, *_ in sampled], ks, vocab)
        tokens, accepted = rejection_sample(target, draft_t, q, torch.tensor(ks), uniforms, noise)
        result.update(_unpack(sampled, tokens, accepted))
    return result


def _unpack(items, tokens: torch.Tensor, accepted: torch.Tensor) -> dict:
    out = {}
    for i, (w, *_rest) in enumerate(items):
        a = int(accepted[i])
        out[id(w)] = (tokens[i, : a + 1].tolist(), a)
    return out
