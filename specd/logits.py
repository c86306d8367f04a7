"""Logits -> probabilities under a request's sampling parameters, and a proposal's draft
probabilities as dense rows: shared by the drafter (drawing) and the verifier (testing)."""

from __future__ import annotations

import functools
import math

import torch

from specd.params import SamplingParams


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """[R, V] -> the first largest column of each row [R] (torch.argmax's answer, NaN
    counting as the largest as there). fp32 rows on the CPU go through numpy: torch's
    argmax takes ~150 us over a 151,936-column row, numpy's ~13."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.requires_grad:
        return logits.argmax(-1)
    return torch.from_numpy(logits.numpy().argmax(-1))


# -- the request's transforms (shared by drafter and verifier) ----------------------------
def presence_of_paths(context: list[int], paths: list[list[int]], vocab: int) -> torch.Tensor:
    """Tokens seen before each row -> bool [R, V]: row n has the context plus paths[n]
    (a chain's row j the drafts d_1..d_j, a tree's node its path)."""
    rows = torch.zeros(len(paths), vocab, dtype=torch.bool)
    if context:
        rows[:, torch.tensor(context)] = True
    for n, path in enumerate(paths):
        if path:
            rows[n, torch.tensor(path)] = True
    return rows


def counts_of_paths(context: list[int], paths: list[list[int]], vocab: int) -> torch.Tensor:
    """How often each token occurs in the context plus paths[n], for each row n ->
    float [R, V]."""
    base = torch.zeros(vocab)
    if context:
        base.index_add_(0, torch.tensor(context), torch.ones(len(context)))
    rows = base.repeat(len(paths), 1)
    for n, path in enumerate(paths):
        if path:
            rows[n].index_add_(0, torch.tensor(path), torch.ones(len(path)))
    return rows


def apply_output_penalties(logits: torch.Tensor, counts: torch.Tensor, params: SamplingParams):
    """OpenAI's frequency and presence penalties: logit - frequency * count - presence *
    [count > 0], `counts` [R, V] of the generated tokens only (as vLLM counts them; the
    repetition penalty sees the prompt too)."""
    counts = counts.to(logits.device)
    return (
        logits
        - params.frequency_penalty * counts
        - params.presence_penalty * (counts > 0).to(logits.dtype)
    )


@functools.lru_cache(maxsize=256)
def bias_row(params: SamplingParams, vocab: int) -> torch.Tensor | None:
    """The request's logit_bias as one dense row [1, vocab], -inf at every token outside
    its allowed_token_ids (None without either). Built once per distinct parameters (a
    request's every step and draft reads the same row, never writing it)."""
    if not params.logit_bias and not params.allowed_token_ids:
        return None
    row = torch.zeros(1, vocab)
    if params.allowed_token_ids:
        row.fill_(-math.inf)
        row[0, list(params.allowed_token_ids)] = 0.0
    for token, bias in params.logit_bias:
        row[0, token] += bias
    return row


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float):
    """logits [R, V], seen bool [R, V] (built on the CPU) -> logits with seen tokens
    penalised, on the logits' device."""
    if penalty == 1.0:
        return logits
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen.to(logits.device), penalised, logits)


def adjustments(
    params: SamplingParams, tokens: list[int], prompt_length: int, paths, vocab: int
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """What the request's logit bias and penalties need at each row n, whose context is
    the committed `tokens` (the first `prompt_length` the prompt) plus paths[n]: (seen,
    counts, bias) as adjust_logits takes them, each None where it does not apply."""
    if not params.adjusts_logits:
        return None, None, None
    seen = counts = None
    if params.repetition_penalty != 1.0:
        seen = presence_of_paths(tokens, paths, vocab)
    if params.output_penalised:
        counts = counts_of_paths(tokens[prompt_length:], paths, vocab)
    return seen, counts, bias_row(params, vocab)


def adjust_logits(
    logits: torch.Tensor,
    params: SamplingParams,
    seen: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits [R, V] after the logit bias (`bias`: [1, V], see bias_row), the repetition
    penalty (`seen`: bool [R, V], the tokens of prompt and output), then the frequency
    and presence penalties (`counts`: [R, V], the output's tokens), as vLLM orders them."""
    if bias is not None:
        logits = logits + bias.to(logits.device)
    if seen is not None:
        logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    if counts is not None:
        logits = apply_output_penalties(logits, counts, params)
    return logits


def logits_to_probs(
    logits: torch.Tensor,
    params: SamplingParams,
    seen: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    infill=None,
) -> torch.Tensor:
    """logits [R, V] (fp32) -> probs [R, V] after adjust_logits (the bias and penalties),
    temperature, top-k, top-p and min-p, in that order (as vLLM), or with the temperature
    last (`params.temperature_last`, llama.cpp's order: the truncations choose from the
    untempered distribution, the temperature then applies to the tokens they keep), then
    llama.cpp's infill sampler where the request asks for it (`infill`: the service's
    specd.infill_filter.InfillFilter; None: not applied). Greedy params give one-hot
    argmax."""
    logits = adjust_logits(logits, params, seen, counts, bias)
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    tempered = logits / params.temperature
    probs = _truncated(logits if params.temperature_last else tempered, params)
    applies_infill = params.infill and infill is not None
    if not applies_infill and (not params.temperature_last or params.temperature == 1.0):
        return probs
    keep = infill.keep(probs) if applies_infill else probs > 0
    out = torch.softmax(tempered, dim=-1).masked_fill(~keep, 0.0)
    total = out.sum(-1, keepdim=True)
    # the infill sampler's end-of-text token may have no probability of its own: it is
    # then drawn for certain, as llama.cpp's one-token candidate list is
    out = torch.where(total > 0, out, keep.float())
    return out / out.sum(-1, keepdim=True)


def _truncated(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """softmax(logits) after top-k, top-p and min-p, renormalised over what they keep."""
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
