"""The log-probabilities a request asks for (SamplingParams.logprobs): each emitted
token's, and the most likely tokens at its position.

They come from the target's raw logits (log_softmax of the forward's row, before a
logit bias, penalties, temperature and top-k/top-p/min-p), as vLLM returns them by
default; a constrained request's after its grammar's mask, as vLLM's sampler gets them
(a token the grammar forbids has -inf). A round's emitted tokens were chosen at the
nodes of its accepted path: the root, then each accepted draft (token i at node
path[i - 1]), so speculation changes which forward computed a row, never the row: with
batch-invariant kernels the values are the same with speculation on and off."""

from __future__ import annotations

from typing import NamedTuple

import torch


class TokenLogprob(NamedTuple):
    logprob: float  # of the emitted token
    top_ids: list[int]  # the most likely tokens there, most likely first
    top_logprobs: list[float]


def emitted(logits: torch.Tensor, tokens: list[int], path: list[int], top: int):
    """A round's logits [nodes, V], its emitted tokens and its accepted nodes (`path`:
    chain nodes 1..a, or a tree's accepted nodes) -> a TokenLogprob per token."""
    nodes = [0, *path][: len(tokens)]
    rows = torch.log_softmax(logits[nodes].float(), dim=-1)
    chosen = rows.gather(1, torch.tensor(tokens, device=rows.device)[:, None])[:, 0].tolist()
    if top == 0:
        return [TokenLogprob(lp, [], []) for lp in chosen]
    values, ids = rows.topk(top, dim=-1)
    return [
        TokenLogprob(lp, i, v)
        for lp, i, v in zip(chosen, ids.tolist(), values.tolist(), strict=True)
    ]
