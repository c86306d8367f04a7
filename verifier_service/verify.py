"""From one step's logits to the tokens each round emits (greedy or exact sampling)."""

from __future__ import annotations

import torch

from specd.proposal import Proposal
from specd.sampling import (
    draw_randomness,
    greedy_verify,
    logits_to_probs,
    onehot_probs,
    presence_of_paths,
    rejection_sample,
    sparse_to_dense,
)
from verifier_service import tree


def _target_rows(seq, proposal: Proposal | None, rows: torch.Tensor) -> torch.Tensor:
    """Target probabilities at every node of the round (p_1..p_{k+1} for a chain, then
    the alternatives) after the request's own transforms; each node has seen its path."""
    seen = None
    if seq.params.repetition_penalty != 1.0:
        paths = tree.node_paths(proposal) if proposal is not None else [[]]
        seen = presence_of_paths(seq.tokens, paths, rows.shape[-1])
    return logits_to_probs(rows, seq.params, seen)


def _draft_q(proposal: Proposal | None, drafts: torch.Tensor, vocab: int) -> torch.Tensor:
    if proposal is None or proposal.q_ids is None:
        return onehot_probs(drafts, vocab)  # deterministic drafter
    return sparse_to_dense(proposal.q_ids, proposal.q_probs.float(), vocab)


def _tree_round(w, proposal: Proposal, rows: torch.Tensor, vocab: int) -> tuple:
    """One sequence's chain + alternatives (verifier_service/tree.py)."""
    seq = w.seq
    if seq.params.greedy:
        penalised = seq.params.repetition_penalty != 1.0
        scored = _target_rows(seq, proposal, rows) if penalised else rows
        tokens, path = tree.verify_tree_greedy(scored.argmax(-1).tolist(), proposal)
    else:
        q = _draft_q(proposal, torch.tensor(proposal.tokens, dtype=torch.long), vocab)
        probs = _target_rows(seq, proposal, rows).cpu()  # with q and the generator
        tokens, path = tree.verify_tree_sampled(probs, q, proposal, seq.generator)
    return tokens, len(path), path


def verify_rounds(rounds, proposals: dict, logits: torch.Tensor, vocab: int) -> dict:
    """rounds: the step's works with logits, in forward order; logits [sum(nodes_i), V]
    (nodes = 1 + k + alternatives). -> {id(work): (emitted tokens, number of drafts
    accepted, accepted tree path or None for a chain)}."""
    greedy, sampled, offset = [], [], 0
    result = {}
    for w in rounds:
        proposal = proposals.get(w.seq.seq_id)
        drafts = proposal.tokens if proposal is not None else []
        nodes = len(drafts) + 1 + (len(proposal.alts) if proposal is not None else 0)
        rows = logits[offset : offset + nodes]  # [nodes, V]
        offset += nodes
        if proposal is not None and proposal.alts:
            result[id(w)] = _tree_round(w, proposal, rows, vocab)
            continue
        item = (w, proposal, drafts, rows)
        (greedy if w.seq.params.greedy else sampled).append(item)
    if greedy:
        k_max = max(len(d) for _, _, d, _ in greedy)
        argmax = torch.zeros(len(greedy), k_max + 1, dtype=torch.long)
        draft_t = torch.zeros(len(greedy), k_max, dtype=torch.long)
        for i, (w, proposal, drafts, rows) in enumerate(greedy):
            if w.seq.params.repetition_penalty != 1.0:
                rows = _target_rows(w.seq, proposal, rows)
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
            target[i, : k + 1] = _target_rows(w.seq, proposal, rows)
            if k:
                draft_t[i, :k] = torch.tensor(drafts, dtype=torch.long)
                q[i, :k] = _draft_q(proposal, draft_t[i, :k], vocab)
        ks = [len(d) for _, _, d, _ in sampled]
        uniforms, noise = draw_randomness([w.seq.generator for w, *_ in sampled], ks, vocab)
        tokens, accepted = rejection_sample(target, draft_t, q, torch.tensor(ks), uniforms, noise)
        result.update(_unpack(sampled, tokens, accepted))
    return result


def mask_logits(rounds, masks: dict, logits: torch.Tensor) -> None:
    """Constrained sequences: -inf, in place, at every token their grammar forbids, at
    every node (masks: seq_id -> bool [nodes, V], specd/grammar.py). Every verification
    path below then works on the masked target, so it stays exact for it."""
    offset = 0
    with torch.inference_mode():  # the forward's output is an inference tensor
        for w in rounds:
            mask = masks.get(w.seq.seq_id)
            if mask is not None:
                rows = logits[offset : offset + w.num_logits]
                rows.masked_fill_(~mask[: w.num_logits].to(rows.device), float("-inf"))
            offset += w.num_logits


def _unpack(items, tokens: torch.Tensor, accepted: torch.Tensor) -> dict:
    out = {}
    for i, (w, *_rest) in enumerate(items):
        a = int(accepted[i])
        out[id(w)] = (tokens[i, : a + 1].tolist(), a, None)
    return out
