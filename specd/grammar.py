"""Grammar state of one constrained sequence: which tokens may come next, for the pending
position and for every node of a draft round, with exact rollback.

`Grammars` is per process (one tokenizer, compiled grammars cached by their text);
`GrammarState` follows one sequence's committed tokens. `plan` walks a proposal: each
draft must be allowed where it stands (the chain is cut before the first that is not, an
alternative that is not is dropped), and the state is rolled back afterwards, so a
proposal leaves no trace. The masks it returns are what the target's logits are masked
with at each node; `mask_q` renormalises the drafter's q on the same masks.

Why masking keeps speculative sampling exact: the target's distribution at a node is
p' = norm(p * allowed). Verification tests drafts against p' as against any p. A draft the
grammar forbids has p'(d) = 0 and would always be rejected, with the residual
norm(max(0, p' - q)) at that node; cutting the chain there and sampling p' instead is the
same in distribution when q is masked too: a drafter that sampled from q and happened to
draw an allowed token drew it from q' = norm(q * allowed), so q' is what the test uses.
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import torch

from specd.constraint import Constraint
from specd.infill_filter import InfillFilter
from specd.proposal import Proposal

_BITS = torch.arange(32, dtype=torch.int32)
# llguidance's error where no token can extend the text: the language has none (not a limit)
NO_TEXT = "NoExtensionBias"
# the end-of-turn tokens llama.cpp looks for, in its order: the infill sampler's end token
END_NAMES = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<EOT>")


def grammar_tokenizer(folder: Path):
    """The tokenizer `Grammars` builds llguidance's view from: the folder's
    `tokenizer.json` through `tokenizers` alone (llguidance reads its JSON as it is, so a
    service imports no transformers for it), else transformers'."""
    path = Path(folder) / "tokenizer.json"
    if not path.is_file():  # a slow tokenizer's files only
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(folder)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


def _lltokenizer(tokenizer, vocab_size: int, eos_ids: set[int]):
    """llguidance's view of the tokenizer (a `tokenizers.Tokenizer` or transformers'),
    `vocab_size` wide (the model's logits). A model without an end-of-sequence token gets
    a virtual one past its vocabulary: the grammar then "stops" instead of asking for it."""
    import llguidance

    n_vocab, eos = vocab_size, sorted(eos_ids)
    if not eos:
        n_vocab, eos = vocab_size + 1, [vocab_size]
    plain = hasattr(tokenizer, "to_str")  # tokenizers' own, not transformers'
    try:
        if plain:  # its JSON, as llguidance.hf hands it transformers' backend
            return llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=n_vocab, eos_token=eos)
        import llguidance.hf

        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=n_vocab, eos_token=eos)
    except ValueError:  # a decoder llguidance cannot read: give it each token's bytes
        size = _size(tokenizer)
        tokens = [tokenizer.decode([i], skip_special_tokens=False).encode() for i in range(size)]
        tokens += [b""] * (n_vocab - len(tokens))
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Tokens(tokens, eos[0])))


def _size(tokenizer) -> int:
    """A `tokenizers.Tokenizer`'s or transformers' tokenizer's tokens, added ones too."""
    if hasattr(tokenizer, "to_str"):
        return tokenizer.get_vocab_size(with_added_tokens=True)
    return len(tokenizer)


class _Tokens:
    """The smallest tokenizer llguidance's TokenizerWrapper takes: bytes per token."""

    bos_token_id = None

    def __init__(self, tokens: list[bytes], eos: int):
        self.tokens, self.eos_token_id = tokens, eos
        self._by_bytes = {t: i for i, t in enumerate(tokens) if t}

    def __call__(self, text: str) -> list[int]:  # greedy longest match, for its tests only
        data, out = text.encode(), []
        while data:
            n = max(n for n in range(1, len(data) + 1) if data[:n] in self._by_bytes or n == 1)
            out.append(self._by_bytes.get(data[:n], 0))
            data = data[n:]
        return out


class Grammars:
    """One tokenizer's grammar matchers (compiled grammars cached by their text), and its
    infill sampler.
    `load_tokenizer` is called at the first constraint (a service that is never sent one
    never reads its tokenizer)."""

    def __init__(self, load_tokenizer, vocab_size: int, eos_ids: set[int] | None = None):
        self.vocab_size = vocab_size
        self._load_tokenizer, self._eos = load_tokenizer, set(eos_ids or ())
        self._ll = None
        self._tokens = 0  # the tokenizer's own tokens (the model's vocabulary may pad them)
        self._infill: InfillFilter | None = None
        self._templates: dict[str, object] = {}
        self._lock = threading.Lock()

    def prepare(self):
        """The tokenizer and llguidance's view of it: ~2 s for a 150k vocabulary from its
        tokenizer.json, once (a caller on an event loop runs it in a worker thread)."""
        with self._lock:
            if self._ll is None:
                tokenizer = self._load_tokenizer()
                self._tokens = _size(tokenizer)
                self._ll = _lltokenizer(tokenizer, self.vocab_size, self._eos)
            return self._ll

    def infill_filter(self) -> InfillFilter:
        """llama.cpp's infill sampler over this tokenizer's tokens (each token's bytes as
        llguidance decodes them; special tokens and the ids past the tokenizer's, none),
        its end token the end-of-sequence token llama.cpp calls end-of-turn (END_NAMES)."""
        ll = self.prepare()
        with self._lock:
            if self._infill is None:
                if not self._eos:
                    raise ValueError("the infill sampler needs an end-of-sequence token")
                pieces = [
                    b"" if ll.is_special_token(i) else ll.decode_bytes([i])
                    for i in range(min(self._tokens, self.vocab_size))
                ]
                named = {ll.decode_bytes([i]).decode(errors="replace"): i for i in self._eos}
                end = next((named[n] for n in END_NAMES if n in named), min(self._eos))
                self._infill = InfillFilter(pieces, self._eos, end)
            return self._infill

    def start(self, constraint: Constraint) -> GrammarState:
        """A fresh state for `constraint`; ValueError when it is invalid or admits nothing."""
        from llguidance import LLMatcher

        grammar = constraint.grammar()
        ll = self.prepare()
        with self._lock:
            template = self._templates.get(grammar)
            if template is None:
                template = LLMatcher(ll, grammar, log_level=0)
                if template.is_error():
                    raise ValueError(f"invalid {constraint.kind}: {template.get_error()}")
                if len(self._templates) >= 256:
                    self._templates.pop(next(iter(self._templates)))
                self._templates[grammar] = template
        words = (ll.vocab_size + 31) // 32  # llguidance's bitmask: one bit per token
        state = GrammarState(template.deep_copy(), constraint, self.vocab_size, words)
        empty = state.done or not state.allowed().any()  # (an empty match counts as none)
        if state.error:
            raise ValueError(state.error)
        if empty:
            raise ValueError(f"the {constraint.kind} constraint admits no output")
        if constraint.after_thinking:  # the thinking admits output: does the answer?
            self.start(dataclasses.replace(constraint, after_thinking=""))
        return state


class GrammarState:
    def __init__(self, matcher, constraint: Constraint, vocab_size: int, words: int):
        self.matcher, self.constraint, self.vocab_size = matcher, constraint, vocab_size
        self.consumed = 0  # tokens committed into the state
        self._words = torch.zeros(words, dtype=torch.int32)

    @property
    def done(self) -> bool:
        """Complete: nothing but end-of-sequence may follow (the request stops here)."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str | None:
        """Why the constraint cannot be followed from here, or None. llguidance builds its
        lexer as the text grows, within limits; past them the matcher stops for good
        (and would allow only end-of-sequence)."""
        why = self.matcher.get_error().strip().splitlines()[0] if self.matcher.is_error() else ""
        if not why or why == NO_TEXT:
            return None
        return f"the {self.constraint.kind} constraint is beyond llguidance's limits: {why}"

    def allowed(self) -> torch.Tensor:
        """bool [vocab_size]: the tokens that may come next. Once the constraint is
        complete every token is allowed: nothing after that point is ever committed (the
        engine stops the sequence), so that row only has to stay a valid distribution."""
        if self.done:
            return torch.ones(self.vocab_size, dtype=torch.bool)
        w = self._words
        self.matcher.unsafe_compute_mask_ptr(w.data_ptr(), w.numel() * w.element_size())
        return ((w[:, None] >> _BITS) & 1).bool().flatten()[: self.vocab_size]

    def consume(self, tokens: list[int]) -> bool:
        """Commit tokens; False (and the state unchanged) if the grammar refuses one."""
        n = self.matcher.validate_tokens(tokens)
        if n < len(tokens):
            return False
        if tokens:
            self.matcher.consume_tokens(tokens)
        self.consumed += len(tokens)
        return True

    def push(self, token: int) -> bool:
        """Advance over a draft, tentatively (`pop` takes it back; `consumed` stays);
        False, and no change, if the grammar refuses it. (Every change is checked first:
        a refused token would put llguidance's matcher in an error state for good.)"""
        return self.valid_prefix([token]) == 1 and self.matcher.consume_token(token)

    def pop(self, n: int) -> None:
        self.matcher.rollback(n)

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens` the grammar allows in a row from here."""
        return self.matcher.validate_tokens(tokens)

    def plan(self, proposal: Proposal) -> tuple[Proposal, torch.Tensor]:
        """-> (the proposal cut to what the grammar allows, masks bool [nodes, V] in the
        verifier's node order: root, chain, alternatives). The state is left as it was."""
        by_parent: dict[int, list[int]] = {}
        for parent, t in proposal.alts:
            by_parent.setdefault(parent, []).append(t)
        chain, alts, alt_masks = [self.allowed()], [], []
        m = self.matcher
        for j, d in enumerate(proposal.tokens):
            if self.done or not chain[j][d]:
                break
            for t in by_parent.get(j, []):  # siblings of d, tried from node j
                if chain[j][t] and m.consume_token(t):
                    alts.append((j, t))
                    alt_masks.append(self.allowed())
                    m.rollback(1)
            m.consume_token(d)
            chain.append(self.allowed())
        k = len(chain) - 1
        m.rollback(k)
        kept = proposal.first(k)
        kept.alts = alts
        if kept.q_ids is not None and k:
            kept.q_probs = mask_q(kept.q_ids, kept.q_probs, torch.stack(chain[:k]))
        return kept, torch.stack(chain + alt_masks)


def mask_q(q_ids: torch.Tensor, q_probs: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """Sparse q [k, m] -> q' = norm(q * allowed) with row j on masks[j] (the node where
    draft j + 1 was drawn)."""
    kept = q_probs * masks.gather(1, q_ids).to(q_probs.dtype)
    total = kept.sum(-1, keepdim=True)
    return torch.where(total > 0, kept / total.clamp(min=1e-30), q_probs)
