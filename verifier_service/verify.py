"""From one step's logits to the tokens each round emits (greedy or exact sampling).

Every round, chain or tree, goes through the same two batched functions of
specd.sampling (greedy_verify, rejection_sample); this module only lays the step's rows
out for them and reads their results back."""

from __future__ import annotations

import torch

from specd.proposal import Proposal
from specd.sampling import (
    Alternatives,
    Verified,
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


def verify_rounds(rounds, proposals: dict, logits: torch.Tensor, vocab: int) -> dict:
    """rounds: the step's works with logits, in forward order; logits [sum(nodes_i), V]
    (nodes = 1 + k + alternatives: a chain is a tree without alternatives). -> {id(work):
    (emitted tokens, number of drafts accepted, accepted tree path or None for a chain)}."""
    greedy, sampled, offset = [], [], 0
    for w in rounds:
        proposal = proposals.get(w.seq.seq_id)
        nodes = 1 + (len(proposal.tokens) + len(proposal.alts) if proposal is not None else 0)
        item = (w, proposal, logits[offset : offset + nodes])  # rows [nodes, V]
        offset += nodes
        (greedy if w.seq.params.greedy else sampled).append(item)
    result = {}
    if greedy:
        result.update(_greedy(greedy))
    if sampled:
        result.update(_sampled(sampled, vocab))
    return result


def _shapes(items) -> tuple[list[int], list[int], int, int]:
    ks = [len(p.tokens) if p is not None else 0 for _, p, _ in items]
    alts = [len(p.alts) if p is not None else 0 for _, p, _ in items]
    return ks, alts, max(ks), max(alts)


def _alternatives(items, a_max: int, uniforms=None) -> Alternatives:
    tokens = torch.zeros(len(items), a_max, dtype=torch.long)
    parents = torch.full((len(items), a_max), -1, dtype=torch.long)
    for i, (_, proposal, _) in enumerate(items):
        for j, (parent, token) in enumerate(proposal.alts if proposal is not None else []):
            parents[i, j], tokens[i, j] = parent, token
    return Alternatives(tokens, parents, uniforms)


def _drafts(items, k_max: int) -> torch.Tensor:
    drafts = torch.zeros(len(items), k_max, dtype=torch.long)
    for i, (_, proposal, _) in enumerate(items):
        if proposal is not None and proposal.tokens:
            drafts[i, : len(proposal.tokens)] = torch.tensor(proposal.tokens, dtype=torch.long)
    return drafts


def _place(target: torch.Tensor, i: int, rows: torch.Tensor, k: int, k_max: int) -> None:
    """Sequence i's node rows into the batch layout: chain nodes at 0..k, alternatives
    from k_max + 1 on."""
    target[i, : k + 1] = rows[: k + 1]
    target[i, k_max + 1 : k_max + 1 + len(rows) - k - 1] = rows[k + 1 :]


def _greedy(items) -> dict:
    ks, alts, k_max, a_max = _shapes(items)
    argmax = torch.zeros(len(items), k_max + 1 + a_max, dtype=torch.long)
    for i, (w, proposal, rows) in enumerate(items):
        if w.seq.params.repetition_penalty != 1.0:
            rows = _target_rows(w.seq, proposal, rows)
        _place(argmax, i, rows.argmax(-1).cpu(), ks[i], k_max)
    out = greedy_verify(
        argmax, _drafts(items, k_max), torch.tensor(ks), _alternatives(items, a_max)
    )
    return _unpack(items, ks, out)


def _sampled(items, vocab: int) -> dict:
    ks, alts, k_max, a_max = _shapes(items)
    n = len(items)
    target = torch.zeros(n, k_max + 1 + a_max, vocab)
    q = torch.zeros(n, k_max, vocab)
    drafts = _drafts(items, k_max)
    for i, (w, proposal, rows) in enumerate(items):
        _place(target, i, _target_rows(w.seq, proposal, rows).cpu(), ks[i], k_max)
        if ks[i]:
            q[i, : ks[i]] = _draft_q(proposal, drafts[i, : ks[i]], vocab)
    generators = [w.seq.generator for w, _, _ in items]
    uniforms, noise, alt_uniforms = draw_randomness(generators, ks, vocab, alts)
    out = rejection_sample(
        target,
        drafts,
        q,
        torch.tensor(ks),
        uniforms,
        noise,
        _alternatives(items, a_max, alt_uniforms),
    )
    return _unpack(items, ks, out)


def _unpack(items, ks: list[int], out: Verified) -> dict:
    result = {}
    for i, (w, proposal, _) in enumerate(items):
        accepted, taken = int(out.accepted[i]), int(out.alternative[i])
        path = None
        if proposal is not None and proposal.alts:  # a tree: the accepted nodes, in order
            path = tree.accepted_path(ks[i], accepted, taken)
        result[id(w)] = (out.tokens[i, : accepted + 1].tolist(), accepted, path)
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
