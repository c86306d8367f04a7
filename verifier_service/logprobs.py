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
    rank: int  # of the emitted token: how many are at least as likely, itself included


def emitted(logits: torch.Tensor, tokens: list[int], path: list[int], top: int):
    """A round's logits [nodes, V], its emitted tokens and its accepted nodes (`path`:
    chain nodes 1..a, or a tree's accepted nodes) -> a TokenLogprob per token."""
    return of_rows(logits[[0, *path][: len(tokens)]], tokens, top)


def prompt_rows(seq, rows: torch.Tensor, start: int) -> None:
    """A prefill chunk's rows [tokens, V] (the chunk from prompt position `start`): the
    prompt tokens they predict (row p gives token p + 1's), with `seq`'s prompt
    log-probabilities not read yet (a recomputed chunk's are), onto `seq`."""
    first = max(start, len(seq.prompt_logprobs))  # rows read before a preemption: skipped
    end = min(start + len(rows), len(seq.prompt) - 1)
    if end > first:
        targets = seq.prompt[first + 1 : end + 1]
        top = seq.params.prompt_logprobs
        seq.prompt_logprobs += of_rows(rows[first - start : end - start], targets, top)


def of_rows(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Rows [n, V] and the token each chose -> a TokenLogprob each."""
    rows = torch.log_softmax(logits.float(), dim=-1)
    chosen = rows.gather(1, torch.tensor(tokens, device=rows.device)[:, None])
    ranks = (rows >= chosen).sum(dim=-1).tolist()
    chosen = chosen[:, 0].tolist()
    if top == 0:
        return [TokenLogprob(lp, [], [], r) for lp, r in zip(chosen, ranks, strict=True)]
    values, ids = rows.topk(top, dim=-1)
    return [
        TokenLogprob(lp, i, v, r)
        for lp, i, v, r in zip(chosen, ids.tolist(), values.tolist(), ranks, strict=True)
    ]
