"""From one step's logits to the tokens each round emits (greedy or exact sampling).

Every round, chain or tree, goes through the same two functions of specd.sampling
(greedy_round per sequence, rejection_sample batched); this module only lays the step's
rows out for them and reads their results back. A seeded sampled round is greedy on the
tokens its seed draws at each position (`_seeded`), so that it emits the same tokens
however it was drafted."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from specd.draws import draw_randomness, position_noise
from specd.logits import (
    adjustments,
    argmax_rows,
    logits_to_probs,
    onehot_probs,
    sparse_to_dense,
)
from specd.proposal import Proposal
from specd.sampling import Alternatives, Verified, greedy_round, rejection_sample
from verifier_service import logprobs, tree
from verifier_service.records import Round


@dataclass(frozen=True)
class Verdict:
    """What one round emits."""

    tokens: list[int]  # the accepted drafts, then the token the target chose after them
    accepted: int  # drafts accepted (an accepted alternative counts)
    path: list[int] | None  # a tree's accepted nodes in order (None for a chain)
    logprobs: list[logprobs.TokenLogprob] | None = None  # per token, where asked for


def _target_rows(seq, proposal: Proposal | None, rows: torch.Tensor) -> torch.Tensor:
    """Target probabilities at every node of the round (p_1..p_{k+1} for a chain, then
    the alternatives) after the request's own transforms; each node has seen its path."""
    if not seq.adjusts_logits:
        return logits_to_probs(rows, seq.params, infill=seq.infill)
    paths = tree.node_paths(proposal) if proposal is not None else [[]]
    rows = seq.ban_bad_words(seq.ban_early_stops(rows, paths), paths)
    adjusted = adjustments(seq.params, seq.tokens, len(seq.prompt), paths, rows.shape[-1])
    return logits_to_probs(rows, seq.params, *adjusted, infill=seq.infill)


def _draft_q(proposal: Proposal | None, drafts: torch.Tensor, vocab: int) -> torch.Tensor:
    if proposal is None or proposal.q_ids is None:
        return onehot_probs(drafts, vocab)  # deterministic drafter
    return sparse_to_dense(proposal.q_ids, proposal.q_probs.float(), vocab)


def verify_rounds(rounds: list[Round], logits: torch.Tensor, vocab: int) -> dict[int, Verdict]:
    """rounds: the step's rounds with logits, in forward order; logits [sum(nodes_i), V]
    (nodes = 1 + k + alternatives: a chain is a tree without alternatives), masked here
    for constrained rounds. -> seq_id -> Verdict."""
    _mask(rounds, logits)
    greedy, seeded, sampled, offset = [], [], [], 0
    for r in rounds:
        item = (r, logits[offset : offset + r.num_logits])  # rows [nodes, V]
        offset += r.num_logits
        params = r.seq.params
        kind = greedy if params.greedy else sampled if params.seed is None else seeded
        kind.append(item)
    result = {}
    if greedy:
        result.update(_greedy(greedy, _argmax_all(greedy, seeded or sampled, logits)))
    if seeded:
        result.update(_seeded(seeded))
    if sampled:
        result.update(_sampled(sampled, vocab))
    _add_logprobs(rounds, logits, result)
    return result


def _add_logprobs(rounds: list[Round], logits: torch.Tensor, verdicts: dict) -> None:
    """The verdicts of the rounds that ask for log-probabilities, with them (from the
    logits as masked, which the verification above leaves as they are)."""
    offset = 0
    for r in rounds:
        top, rows = r.seq.params.logprobs, logits[offset : offset + r.num_logits]
        offset += r.num_logits
        if top is None:
            continue
        v = verdicts[r.slot.seq_id]
        path = v.path if v.path is not None else list(range(1, v.accepted + 1))
        verdicts[r.slot.seq_id] = replace(v, logprobs=logprobs.emitted(rows, v.tokens, path, top))


def _argmax_all(greedy, sampled, logits: torch.Tensor) -> list[int] | None:
    """Every row's argmax in one call where every round of the step is greedy on the
    target's own logits (the usual step): on a GPU one kernel and one copy back for the
    step, not one of each (and a wait) a sequence. None otherwise."""
    if sampled or any(r.seq.adjusts_logits for r, _ in greedy):
        return None
    return argmax_rows(logits).tolist()


def _mask(rounds: list[Round], logits: torch.Tensor) -> None:
    """Constrained rounds: -inf, in place, at every token their grammar forbids, at every
    node (specd/grammar.py). Every verification below then works on the masked target,
    so it stays exact for it."""
    offset = 0
    with torch.inference_mode():  # the forward's output is an inference tensor
        for r in rounds:
            if r.mask is not None:
                rows = logits[offset : offset + r.num_logits]
                rows.masked_fill_(~r.mask[: r.num_logits].to(rows.device), float("-inf"))
            offset += r.num_logits


def _shapes(items) -> tuple[list[int], list[int], int, int]:
    ks = [r.k for r, _ in items]
    alts = [len(r.proposal.alts) if r.proposal is not None else 0 for r, _ in items]
    return ks, alts, max(ks), max(alts)


def _alternatives(items, a_max: int, uniforms: torch.Tensor) -> Alternatives:
    tokens = torch.zeros(len(items), a_max, dtype=torch.long)
    parents = torch.full((len(items), a_max), -1, dtype=torch.long)
    for i, (r, _) in enumerate(items):
        for j, (parent, token) in enumerate(r.proposal.alts if r.proposal is not None else []):
            parents[i, j], tokens[i, j] = parent, token
    return Alternatives(tokens, parents, uniforms)


def _drafts(items, k_max: int) -> torch.Tensor:
    drafts = torch.zeros(len(items), k_max, dtype=torch.long)
    for i, (r, _) in enumerate(items):
        if r.k:
            drafts[i, : r.k] = torch.tensor(r.proposal.tokens, dtype=torch.long)
    return drafts


def _place(target: torch.Tensor, i: int, rows: torch.Tensor, k: int, k_max: int) -> None:
    """Sequence i's node rows into the batch layout: chain nodes at 0..k, alternatives
    from k_max + 1 on."""
    target[i, : k + 1] = rows[: k + 1]
    target[i, k_max + 1 : k_max + 1 + len(rows) - k - 1] = rows[k + 1 :]


def _greedy(items, argmax: list[int] | None = None) -> dict:
    """`argmax`: every row's, in the items' order (`_argmax_all`), or None to take each
    round's from its rows."""
    result, offset = {}, 0
    for r, rows in items:
        if argmax is not None:
            best = argmax[offset : offset + len(rows)]
            offset += len(rows)
        else:
            if r.seq.adjusts_logits:
                rows = _target_rows(r.seq, r.proposal, rows)
            best = argmax_rows(rows).tolist()
        p = r.proposal
        drafts, alts = (p.tokens, p.alts) if p is not None else ([], [])
        tokens, accepted, taken = greedy_round(best, drafts, alts)
        result[r.slot.seq_id] = _verdict(r, tokens, accepted, taken)
    return result


def _seeded(items) -> dict:
    """Seeded sampled rounds: the target's token at a node is argmax p(x) / E(x), E the
    request's draws at the node's position in the output (specd.draws.position_noise),
    an exact sample from p; the drafts are verified against those tokens as greedy ones
    are. A node's token then depends on its position and the tokens before it alone, not
    on how many drafts, leaves or rounds led there: the output is the same drafted or not
    (a drafter that drafts with the same draws has its drafts taken where it agrees)."""
    result = {}
    for r, rows in items:
        probs = _target_rows(r.seq, r.proposal, rows).cpu()  # [nodes, V]
        p = r.proposal
        drafts, alts = (p.tokens, p.alts) if p is not None else ([], [])
        # the chain's nodes 0..k, then each leaf's: the position after its parent's
        depths = [*range(len(drafts) + 1), *(parent + 1 for parent, _ in alts)]
        # draws only up to the last token any node may emit: a truncated p (top-k, top-p)
        # needs a few, and a position's draws are a prefix of the whole vocabulary's
        width = int(probs.amax(0).nonzero().max()) + 1
        start, seed, noise = len(r.seq.tokens), r.seq.params.seed, {}
        best = []
        for row, depth in zip(probs[:, :width], depths, strict=True):
            if depth not in noise:
                noise[depth] = position_noise(seed, start + depth, width)
            best.append(int((row / noise[depth]).argmax()))
        tokens, accepted, taken = greedy_round(best, drafts, alts)
        result[r.slot.seq_id] = _verdict(r, tokens, accepted, taken)
    return result


def _sampled(items, vocab: int) -> dict:
    ks, alts, k_max, a_max = _shapes(items)
    n = len(items)
    target = torch.zeros(n, k_max + 1 + a_max, vocab)
    q = torch.zeros(n, k_max, vocab)
    drafts = _drafts(items, k_max)
    for i, (r, rows) in enumerate(items):
        _place(target, i, _target_rows(r.seq, r.proposal, rows).cpu(), ks[i], k_max)
        if ks[i]:
            q[i, : ks[i]] = _draft_q(r.proposal, drafts[i, : ks[i]], vocab)
    generators = [r.seq.generator for r, _ in items]
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
    return _unpack(items, out)


def _unpack(items, out: Verified) -> dict[int, Verdict]:
    result = {}
    for i, (r, _) in enumerate(items):
        accepted, taken = int(out.accepted[i]), int(out.alternative[i])
        tokens = out.tokens[i, : accepted + 1].tolist()
        result[r.slot.seq_id] = _verdict(r, tokens, accepted, taken)
    return result


def _verdict(r: Round, tokens: list[int], accepted: int, taken: int) -> Verdict:
    """A round's verdict; a tree's with the path of its accepted nodes."""
    path = None
    if r.proposal is not None and r.proposal.alts:
        path = tree.accepted_path(r.k, accepted, taken)
    return Verdict(tokens, accepted, path)
