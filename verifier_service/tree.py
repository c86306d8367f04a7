"""Wider verification: a draft chain plus alternative leaves, verified in one forward.

A proposal's chain d_1..d_k may come with alternatives: (parent, token) pairs, each a
sibling of chain draft d_{parent+1} (parent 0 is the pending token, the tree's root).
Nodes are numbered 0 (root), 1..k (the chain), k+1.. (the alternatives, in order), and
fed to the target in that order with a tree mask (specd.models.paged_kv.SeqInput.parents),
so one forward gives p at every node. The round is verified by the same functions as a
chain (specd.sampling: greedy_round, rejection_sample); this module has the tree's shape:
parents for the forward, each node's path, and the K/V moves after it.

The accepted path is written where the chain's K/V would be: `moves` says which positions
to copy before the sequence is truncated to the accepted length.
"""

from __future__ import annotations

from specd.proposal import Proposal


def tree_parents(num_fed: int, proposal: Proposal) -> list[int]:
    """Parent index of every fed token (`num_fed` committed tokens, then chain, then
    alternatives) for SeqInput.parents."""
    root = num_fed - 1  # the last committed token is node 0
    parents = list(range(-1, num_fed - 1))
    parents += [root + j for j in range(len(proposal.tokens))]  # chain node j+1 <- node j
    parents += [root + parent for parent, _ in proposal.alts]
    return parents


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


def accepted_path(k: int, accepted: int, alternative: int) -> list[int]:
    """The accepted nodes in order: chain nodes 1..a, then the alternative taken (node
    k + 1 + alternative) when there is one; `accepted` counts it."""
    chain = accepted - (alternative >= 0)
    return list(range(1, chain + 1)) + ([k + 1 + alternative] if alternative >= 0 else [])


def moves(root_position: int, path: list[int]) -> list[tuple[int, int]]:
    """K/V copies that put the accepted path at the chain's positions: node n was fed at
    root_position + n; the path's j-th node belongs at root_position + j."""
    return [(root_position + n, root_position + j) for j, n in enumerate(path, 1) if n != j]
