"""Wider verification: a draft chain plus alternative leaves, verified in one forward.

A proposal's chain d_1..d_k may come with alternatives: (parent, token) pairs, each a
sibling of chain draft d_{parent+1} (parent 0 is the pending token, the tree's root).
Nodes are numbered 0 (root), 1..k (the chain), k+1.. (the alternatives, in order), and
fed to the target in that order with a tree mask (specd.models.paged_kv.SeqInput.parents),
so one forward gives p at every node.

Verification walks from the root. At a node with children c_1..c_n (the chain child
first, then the alternatives in order):
  greedy     descend into the child whose token is argmax p; none: emit argmax p, stop.
  sampling   iterative speculative sampling (../shared/seeds/003, section 2): test c_1
             as usual (accept x with probability min(1, p(x) / q(x))); on rejection
             p <- norm(max(0, p - q)) and test c_2 against that residual, and so on; if
             every child is rejected, emit a sample of the last residual.
Alternatives are verified as deterministic proposals (q one-hot at their token). That is
exact whatever chose them, the chain's sampled token beside them included: once the children
before it are rejected the node's residual p' no longer depends on which tokens they were,
and testing any fixed token x against p' (accept with probability p'(x), else sample
norm(p' without x)) emits exactly p'. So each emitted token is distributed as p. A
duplicate of a rejected child is always rejected (rejecting x means p(x) < q(x), which
leaves no residual mass at x), so drafters leave duplicates out.

The accepted path is written where the chain's K/V would be: `moves` says which positions
to copy before the sequence is truncated to the accepted length.
"""

from __future__ import annotations

import torch

from specd.proposal import Proposal


def tree_parents(num_fed: int, proposal: Proposal) -> list[int]:
    """Parent index of every fed token (`num_fed` committed tokens, then chain, then
    alternatives) for SeqInput.parents."""
    root = num_fed - 1  # the last committed token is node 0
    parents = list(range(-1, num_fed - 1))
    parents += [root + j for j in range(len(proposal.tokens))]  # chain node j+1 <- node j
    parents += [root + parent for parent, _ in proposal.alts]
    return parents


def children(proposal: Proposal) -> dict[int, list[int]]:
    """Node -> its children's node ids, chain child first."""
    k = len(proposal.tokens)
    out: dict[int, list[int]] = {j: [j + 1] for j in range(k)}
    out[k] = []
    for i, (parent, _) in enumerate(proposal.alts):
        out[parent].append(k + 1 + i)
    return out


def node_tokens(proposal: Proposal) -> list[int]:
    """Token of each node 1.. (node 0, the root, is not a draft)."""
    return list(proposal.tokens) + [t for _, t in proposal.alts]


def node_paths(proposal: Proposal) -> list[list[int]]:
    """Tokens from the root to each node (node 0: none), for per-node transforms."""
    tokens = node_tokens(proposal)
    k = len(proposal.tokens)
    paths = [[]] + [list(proposal.tokens[: j + 1]) for j in range(k)]
    paths += [paths[parent] + [tokens[k + i]] for i, (parent, _) in enumerate(proposal.alts)]
    return paths


def verify_tree_greedy(argmax: list[int], proposal: Proposal) -> tuple[list[int], list[int]]:
    """argmax: target argmax at every node -> (emitted tokens, accepted path of nodes)."""
    kids, tokens = children(proposal), node_tokens(proposal)
    node, path = 0, []
    while True:
        want = argmax[node]
        nxt = next((c for c in kids.get(node, []) if tokens[c - 1] == want), None)
        if nxt is None:
            return [tokens[n - 1] for n in path] + [want], path
        path.append(nxt)
        node = nxt


def verify_tree_sampled(
    probs: torch.Tensor, q_chain: torch.Tensor, proposal: Proposal, generator: torch.Generator
) -> tuple[list[int], list[int]]:
    """probs [nodes, V]: the target's p at every node after the request's transforms;
    q_chain [k, V]: dense q of each chain draft (one-hot for a deterministic drafter).
    Draws from the request's generator -> (emitted tokens, accepted path of nodes)."""
    kids, tokens = children(proposal), node_tokens(proposal)
    k = len(proposal.tokens)
    node, path = 0, []
    while True:
        p = probs[node]
        accepted = None
        for child in kids.get(node, []):
            x = tokens[child - 1]
            q = q_chain[child - 1] if child <= k else None  # None: one-hot at x
            q_x = 1.0 if q is None else float(q[x])
            u = float(torch.rand((), generator=generator))
            if u * q_x < float(p[x]):  # u < p(x) / q(x)
                accepted = child
                break
            if q is None:
                residual = p.clone()
                residual[x] = 0.0
            else:
                residual = (p - q).clamp(min=0.0)
            total = float(residual.sum())
            if total > 0:  # else p == q numerically: the rejection had probability 0
                p = residual / total
        if accepted is None:
            noise = torch.empty(p.shape[-1]).exponential_(generator=generator)
            last = int((p / noise).argmax())
            return [tokens[n - 1] for n in path] + [last], path
        path.append(accepted)
        node = accepted


def moves(root_position: int, path: list[int]) -> list[tuple[int, int]]:
    """K/V copies that put the accepted path at the chain's positions: node n was fed at
    root_position + n; the path's j-th node belongs at root_position + j."""
    return [(root_position + n, root_position + j) for j, n in enumerate(path, 1) if n != j]
