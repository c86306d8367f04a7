"""One sequence's part of a forward: new tokens after what is cached, as a chain or as a
tree of candidate continuations verified together."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SeqInput:
    """One sequence's part of a forward: `tokens` are appended after what is cached;
    logits come back for its last `num_logits` new tokens (0 for a non-final prefill chunk).

    `parents` makes the new tokens a tree (several candidate continuations verified in one
    forward): parents[i] is the index in `tokens` of token i's parent, -1 for the last
    cached token, always < i. A token sits at the position after its parent's and attends
    to the cache and its own ancestors only. None: a chain (parents[i] = i - 1)."""

    seq_id: object
    tokens: list[int]
    num_logits: int = 1
    parents: list[int] | None = None

    def depths(self) -> list[int]:
        """Offset of each new token's position from the first one's."""
        if self.parents is None:
            return list(range(len(self.tokens)))
        depth: list[int] = []
        for i, parent in enumerate(self.parents):
            if not -1 <= parent < i:
                raise ValueError(f"token {i}'s parent {parent} is not an earlier token")
            depth.append(0 if parent < 0 else depth[parent] + 1)
        return depth

    def ancestry(self) -> torch.Tensor:
        """bool [n, n]: [i, j] when new token j is token i or one of its ancestors."""
        n = len(self.tokens)
        if self.parents is None:
            return torch.ones(n, n, dtype=torch.bool).tril()
        seen = torch.zeros(n, n, dtype=torch.bool)
        for i, parent in enumerate(self.parents):
            if parent >= 0:
                seen[i] = seen[parent]
            seen[i, i] = True
        return seen
