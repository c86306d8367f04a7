"""llama.cpp's `infill` sampler (SamplingParams.infill), which its /infill clients such as
llama.vscode list: for fill-in-the-middle, which of a row's candidates (the tokens top-k,
top-p and min-p left) may be drawn.

With p the candidates' probabilities renormalised over them, n of them:
1. when the end-of-generation tokens' mass e is large against the text tokens' t
   (3 * e * n > t), only the end-of-generation tokens stay;
2. else a candidate whose text begins another's is merged with it: the more likely of the
   two takes both masses and the other leaves (each candidate against every other, most
   likely first, as llama.cpp walks them);
3. then a text token below 0.2 leaves; end-of-generation tokens stay;
4. where no text token is left, the end-of-text token alone stays;
5. else, renormalised over what stayed, a text token below 1 / (m + 1) leaves, m the
   text tokens that stayed.

What stays is a set: llama.cpp's last step draws from the softmax of the kept tokens'
logits, so the merged masses decide which tokens stay, not how likely they are. The row
the request samples from (and speculation verifies against) is that softmax.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

THRESHOLD = 0.2  # a text token's merged probability below this leaves


class InfillFilter:
    def __init__(self, pieces: list[bytes], eog: Iterable[int], end: int):
        """`pieces`: each token's text as bytes (b"" for special tokens, which begin
        nothing); `eog`: the end-of-generation ids; `end`: the token kept when no text
        token is."""
        self.pieces = pieces
        self.eog = frozenset(eog)
        self.end = end

    def keep(self, probs: torch.Tensor) -> torch.Tensor:
        """probs [R, V], each row over its candidates (zero elsewhere) -> bool [R, V]:
        the tokens each row may draw."""
        keep = torch.zeros(probs.shape, dtype=torch.bool)
        for r, row in enumerate(probs.detach().float().cpu()):
            keep[r, self._kept(row)] = True
        return keep.to(probs.device)

    def _kept(self, row: torch.Tensor) -> list[int]:
        ids = row.nonzero()[:, 0]
        order = torch.argsort(row[ids], descending=True, stable=True)
        ids = ids[order].tolist()
        p = row[ids].tolist()
        eog = [t in self.eog for t in ids]
        eog_mass = sum(q for q, e in zip(p, eog, strict=True) if e)
        text_mass = sum(q for q, e in zip(p, eog, strict=True) if not e)
        if 3 * eog_mass * len(ids) > text_mass:
            return [t for t, e in zip(ids, eog, strict=True) if e]
        pieces = [self.pieces[t] if t < len(self.pieces) else b"" for t in ids]
        gone = [False] * len(ids)
        for i, a in enumerate(pieces):
            for j, b in enumerate(pieces):
                if gone[i]:
                    break
                if i == j or gone[j] or not a or not b.startswith(a):
                    continue
                into, out = (j, i) if p[j] > p[i] else (i, j)  # the likelier takes both
                p[into], p[out], gone[out] = p[into] + p[out], 0.0, True
        kept = [
            (t, q, e)
            for t, q, e, g in zip(ids, p, eog, gone, strict=True)
            if not g and (e or q >= THRESHOLD)
        ]
        texts = sum(not e for _, _, e in kept)
        if not texts:
            return [self.end]
        # then, renormalised over what stayed, a text token below 1 / (texts + 1) leaves
        total = sum(q for _, q, _ in kept)
        return [t for t, q, e in kept if e or q / total >= 1 / (texts + 1)]
