"""Drafting with a small model on its own paged KV cache.

Per round, for all sequences at once: roll the cache back to what the verifier committed
(`truncate_to` past the common prefix), catch up on committed tokens it has not seen (the
prompt on the first round: lazy prefill; later the accepted drafts' tail and the
recovered/bonus token), then k batched single-token forwards. The k-th draft is never fed
back: if it is accepted it arrives next round as a committed token.

A long prompt is drafted from its last tokens only (`context_window`, specd.proposal's
`view_start`): the view of it starts where the draft model computes fewer than twice
that many tokens, at position 0 there. The output stays the target's (the verifier
decides every token); what the window bounds is the drafter's prefill and attention,
which on a CPU's shared cores cost more at a few thousand tokens than the drafts win
back (docs/benchmarks-log.md section 137).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from specd.draws import make_generator, position_noise
from specd.kvcache import NoFreeBlocks
from specd.logits import adjust_logits, adjustments, logits_to_probs
from specd.models.paged_kv import PagedKV
from specd.models.seq_input import SeqInput
from specd.proposal import DraftState, Proposal, continuable, view_start

# on a GPU, draft steps of up to GRAPH_SEQS sequences and catch-ups of up to GRAPH_ROWS
# tokens replay CUDA graphs (specd.models.gpu.graphs); larger ones run eagerly
GRAPH_SEQS = 32
GRAPH_ROWS = 64


@dataclass
class _Drafting:
    """One sequence's round in progress."""

    state: DraftState
    feed: list[int]  # tokens the draft model has not seen yet
    tokens: list[int] = field(default_factory=list)
    q_ids: list[torch.Tensor] = field(default_factory=list)
    q_probs: list[torch.Tensor] = field(default_factory=list)
    alts: list[tuple[int, int]] = field(default_factory=list)
    # no more drafts this round: the grammar allows none, or the last draft was unsure
    halted: bool = False

    def proposal(self) -> Proposal:
        """The drafts; a constrained sequence's grammar goes back to where it was."""
        if self.state.grammar is not None and self.tokens:
            self.state.grammar.pop(len(self.tokens))
        p = Proposal(self.tokens, alts=self.alts)
        if self.q_ids:
            p.q_ids, p.q_probs = torch.stack(self.q_ids), torch.stack(self.q_probs)
        return p


class DraftModelProposer:
    available = True

    def __init__(
        self,
        model,
        num_blocks: int,
        block_size: int = 16,
        top_m: int = 32,
        alternatives: int = 0,
        prefix_cache: bool = False,
        p_min: float = 0.0,
        context_window: int = 0,
        graphs: bool = True,
    ):
        self.model = model
        self.context_window = context_window  # 0: every sequence drafted from its first token
        self.alternatives = alternatives  # runner-up leaves beside the first drafts
        # a round stops after a draft the draft model gave a probability under p_min (that
        # draft is still verified): DrafterConfig.p_min
        self.p_min = p_min
        # a sequence starts on the cached prefix of an earlier one (specd.kvcache); its
        # blocks are published when it closes (while it runs, drafts come and go in them)
        self.kv = PagedKV.for_model(model, num_blocks, block_size, prefix_cache)
        model.prepare_steps(self.kv, GRAPH_SEQS, GRAPH_ROWS, graphs)  # CUDA; else nothing
        self.top_m = top_m
        self._cached: dict[object, list[int]] = {}  # tokens whose K/V the drafter holds
        self._start: dict[object, int] = {}  # where each sequence's view starts
        self._gens: dict[object, torch.Generator] = {}
        self._last: list = []  # (state, proposal) of the last round, for draft_ahead
        self._ahead: dict = {}  # seq_id -> [(committed tokens it assumes, proposal)], a chain
        self.ahead_hits = 0  # rounds answered from draft_ahead's work
        self.cut_rounds = 0  # rounds that p_min stopped before their k

    @property
    def num_sessions(self) -> int:
        return len(self._cached)

    def close(self, seq_id) -> None:
        cached = self._cached.pop(seq_id, None)
        if cached is not None:
            self.kv.allocator.publish(seq_id, cached)
        self.kv.allocator.free(seq_id)
        self._start.pop(seq_id, None)
        self._gens.pop(seq_id, None)
        self._ahead.pop(seq_id, None)
        self._last = [(s, p) for s, p in self._last if s.seq_id != seq_id]

    def forget_cached(self) -> None:
        self.kv.allocator.forget_cached()

    def propose(self, states: list[DraftState]) -> list[Proposal]:
        """Drafts for each state; a round prepared by draft_ahead for exactly these
        committed tokens is returned without running the model."""
        ahead, self._ahead = self._ahead, {}
        ready: dict[int, Proposal] = {}
        for s in states:
            hit = next((p for tokens, p in ahead.get(s.seq_id, ()) if tokens == s.tokens), None)
            if hit is not None and len(hit.tokens) >= s.k > 0:
                ready[id(s)] = hit.first(s.k)
        self.ahead_hits += len(ready)
        rest = [s for s in states if id(s) not in ready]
        drafted = iter(self._propose(rest))
        out = [ready[id(s)] if id(s) in ready else next(drafted) for s in states]
        self._last = continuable(zip(states, out, strict=True))
        return out

    def draft_ahead(self, stop=lambda: False) -> list[tuple[DraftState, Proposal]]:
        """Between rounds (the verifier is busy verifying): continue the last round's
        sequences as if every draft will be accepted, guessing the target's bonus token
        with the drafter's own next token. The next round's propose returns that work at
        once when the committed tokens match exactly; otherwise it only cost spare time
        (and the cache rolls back as usual). `stop()` is polled between forwards.
        Called again, it continues from what it made (the next round's drafts, also
        assumed all accepted). -> each sequence's assumed state (its tokens those the
        drafts follow) and drafts, for the server to push to a verifier that takes them
        without asking."""
        last, self._last = self._last, []
        if not last:
            return []
        chains = [DraftState(s.seq_id, s.tokens + p.tokens, s.params, 1) for s, p in last]
        guesses = self._propose(chains, stop)  # feeds the last drafts; 1 token: the bonus
        hyp = [
            DraftState(s.seq_id, c.tokens + g.tokens, s.params, s.k)
            for (s, _), c, g in zip(last, chains, guesses, strict=True)
            if g.tokens
        ]
        if not hyp or stop():
            return []
        made = list(zip(hyp, self._propose(hyp, stop), strict=True))
        for s, p in made:
            self._ahead.setdefault(s.seq_id, []).append((s.tokens, p))
        self._last = continuable(made)
        return made

    def _propose(self, states: list[DraftState], stop=None) -> list[Proposal]:
        active = [
            _Drafting(s, s.tokens[self._start[s.seq_id] + len(self._cached[s.seq_id]) :])
            for s in states
            if s.k > 0 and s.tokens and self._sync(s)
        ]
        for step in range(max((d.state.k for d in active), default=0)):
            if stop is not None and stop():
                break  # a new round is waiting: hand back what is drafted so far
            batch = [d for d in active if d.state.k > step and not d.halted]
            if not batch:
                break
            try:
                inputs = [SeqInput(d.state.seq_id, d.feed) for d in batch]
                logits = self.model.forward(self.kv, inputs)
            except NoFreeBlocks:
                break  # the drafter's cache is full: propose what we have so far
            picks = self._picks(batch, logits)
            for d, row, pick in zip(batch, logits, picks, strict=True):
                self._step(d, row, step, pick)
        done = {id(d.state): d.proposal() for d in active}
        return [done.get(id(s), Proposal()) for s in states]

    def _picks(self, batch: list[_Drafting], logits: torch.Tensor) -> list:
        """`greedy_picks` of the step's rows for those whose draft is their raw logits'
        argmax (greedy, no grammar, no repetition penalty on the row); None for the
        others, which draw on their own."""
        plain = [self._plain_greedy(d.state) for d in batch]
        if not any(plain):
            return [None] * len(batch)
        return [pick if p else None for pick, p in zip(greedy_picks(logits), plain, strict=True)]

    def _plain_greedy(self, s: DraftState) -> bool:
        return s.params.greedy and s.grammar is None and not s.params.adjusts_logits

    def _step(self, d: _Drafting, row: torch.Tensor, step: int, pick=None) -> None:
        """One draft for one sequence from its logits row (or its halt); `pick`: the
        row's `greedy_pick`, where `_picks` made it."""
        s = d.state
        self._cached[s.seq_id] += d.feed
        row = self._constrained(s, row)
        if row is None:  # the grammar allows nothing the head can draft
            d.halted = True
            return
        token, confidence, ids, probs, alt = self._draw(s, row, d.tokens, pick)
        if s.grammar is not None and not s.grammar.push(token):  # popped in proposal()
            d.halted = True
            return
        if alt is not None and step < self.alternatives:
            d.alts.append((step, alt))
        d.tokens.append(token)
        d.feed = [token]
        d.halted = confidence < self.p_min
        self.cut_rounds += d.halted and step + 1 < s.k
        if ids is not None:
            d.q_ids.append(ids)
            d.q_probs.append(probs)

    def _constrained(self, s: DraftState, logits: torch.Tensor):
        """A constrained sequence's logits masked to what its grammar allows after its
        drafts so far (so q is the masked q); None when the head has no allowed token."""
        if s.grammar is None:
            return logits
        if s.grammar.done:
            return None
        allowed = s.grammar.allowed()
        if self.model.head_ids is not None:
            allowed = allowed[self.model.head_ids.cpu()]
        if not allowed.any():
            return None
        return logits.masked_fill(~allowed.to(logits.device), float("-inf"))

    def _sync(self, s: DraftState) -> bool:
        """Roll back to the longest prefix shared with the committed tokens (in the
        sequence's view: its tokens from `_start` on)."""
        alloc = self.kv.allocator
        if s.seq_id not in self._cached:
            start, window = 0, self.context_window
            if window and len(s.tokens) > window:  # the cache may hold all but the window
                cached = alloc.cached_prefix(s.tokens[:-1], s.cache_salt)
                start = view_start(len(s.tokens), window, cached)
            self._start[s.seq_id] = start
            view = s.tokens[start:-1]  # feed >= 1
            found = alloc.allocate(s.seq_id, tokens=view, salt=s.cache_salt)
            self._cached[s.seq_id] = view[:found]
            # an unseeded request's draws (a seeded one's: position_noise)
            self._gens[s.seq_id] = make_generator(None)
        cached, view = self._cached[s.seq_id], s.tokens[self._start[s.seq_id] :]
        common = 0
        for a, b in zip(cached, view, strict=False):
            if a != b:
                break
            common += 1
        common = min(common, len(view) - 1)  # always feed at least one token
        alloc.truncate_to(s.seq_id, common)
        del cached[common:]
        return True

    def _draw(self, s: DraftState, logits: torch.Tensor, so_far: list[int], pick=None):
        """One draft token -> (token, its probability under the draft model, q's ids, q's
        probs, alternative). Greedy drafting sends no q, sampling sends its top-m q (the
        probability is then the drawn token's in that q). The alternative is the most
        likely other token: the runner-up when greedy; q's mode when sampling, or its
        runner-up if the mode was drawn (exact either way: verifier_service/tree.py).
        The request's logit bias and penalties apply as the verifier applies them (the
        output counted from `prompt_length`, the drafts so far with it). With a trimmed
        head, logits cover only `head_ids` (q's support shrinks with it)."""
        head_ids, vocab = self.model.head_ids, self.model.args.vocab_size

        def token_id(col) -> int:
            return int(col) if head_ids is None else int(head_ids[col])

        def on_head(rows: torch.Tensor) -> torch.Tensor:  # [1, vocab] -> the head's columns
            return rows if head_ids is None else rows[:, head_ids.cpu()]

        adjusted = adjustments(s.params, s.tokens, s.prompt_length, [so_far], vocab)
        adjusted = [None if a is None else on_head(a) for a in adjusted]
        if s.params.greedy:
            row = adjust_logits(logits[None], s.params, *adjusted)
            col, confidence, other = pick or greedy_pick(row[0])
            alt = None if other is None else token_id(other)
            return token_id(col), confidence, None, None, alt
        probs = logits_to_probs(logits[None], s.params, *adjusted)[0]
        vals, cols = probs.topk(min(self.top_m, probs.shape[-1]))
        # q: the truncated, renormalised distribution we draw from, on the CPU where the
        # request's generator is (and where the proposal goes on the wire)
        vals, cols = vals.cpu(), cols.cpu()
        vals = vals / vals.sum()
        ids = cols if head_ids is None else head_ids[cols.to(head_ids.device)].cpu()
        if s.params.seed is None:
            noise = torch.empty_like(vals).exponential_(generator=self._gens[s.seq_id])
        else:  # the draws the verifier takes its token with at this position: agreed on
            position = len(s.tokens) + len(so_far)
            # its draws up to q's largest id only (the rest a prefix of them)
            noise = position_noise(s.params.seed, position, int(ids.max()) + 1)[ids]
        idx = int((vals / noise).argmax())
        other = 1 if idx == 0 else 0
        alt = int(ids[other]) if other < len(ids) and vals[other] > 0 else None
        return int(ids[idx]), float(vals[idx]), ids, vals, alt


def greedy_pick(row: torch.Tensor) -> tuple[int, float, int | None]:
    """A logits row [V] -> (its argmax, that token's softmax probability, the runner-up's
    column or None where there is no finite one). The probability is 1 / sum(exp(row -
    max)): softmax's largest value without the whole softmax. On the CPU all in numpy,
    one thread: torch's topk and max take ~50-90 us over a 49,152-token row (numpy's
    argmax ~4), and its exp and sum ran on the OpenMP team, ~0.44 ms a draft in all
    after a forward against ~0.25 here (docs/benchmarks-log.md section 50). The runner-up is the
    argmax with the best set aside, so it is found even where its exp underflows."""
    if row.device.type != "cpu" or row.dtype != torch.float32:
        best, top = row.topk(min(2, row.shape[-1]))
        other = int(top[1]) if len(top) > 1 and best[1].isfinite() else None
        return int(top[0]), float((best[0] - row.logsumexp(-1)).exp()), other
    values = row.numpy()
    col = int(values.argmax())
    top = values[col]
    confidence = 1.0 / float(np.exp(values - top).sum())
    values[col] = -np.inf  # (the row is the caller's: put back below)
    other = int(values.argmax())
    values[col] = top
    return col, confidence, other if other != col and np.isfinite(values[other]) else None


def greedy_picks(rows: torch.Tensor) -> list[tuple[int, float, int | None]]:
    """`greedy_pick` of each row of [B, V], the same values: numpy row by row on the
    CPU's fp32 rows (microseconds a row), else one batch of kernels and three copies back
    (on a GPU a pick a row is a few kernels and waits)."""
    if rows.device.type == "cpu" and rows.dtype == torch.float32:
        return [greedy_pick(row) for row in rows]
    best, top = rows.topk(min(2, rows.shape[-1]), dim=-1)
    confidence = (best[:, 0] - rows.logsumexp(-1)).exp().tolist()
    second = best[:, 1].isfinite().tolist() if best.shape[-1] > 1 else [False] * len(rows)
    return [
        (cols[0], float(p), cols[1] if finite else None)
        for cols, p, finite in zip(top.tolist(), confidence, second, strict=True)
    ]


def load_draft_model(
    spec,
    dtype: str = "auto",
    device: str | None = None,
    weights: str = "bf16",
    vocab: int = 0,
    kv: str = "auto",
):
    """The draft model, loaded once with a drafter's cuts (specd.models.loader's
    `draft_vocab`): every matrix at 4 bits under int4, a head trimmed to the `vocab` most
    frequent tokens, and on a GPU GEMMs of each step's own rows."""
    from specd.models.loader import load_model

    return load_model(spec, dtype, device, weights, kv, draft_vocab=vocab)
