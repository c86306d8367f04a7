"""A GPU step's inputs, packed into one int64 buffer so that one copy moves them to the
device, and the views the kernels read.

Layout, for a step laid out with `padded` rows (specd.models.gpu.row_gemm) and a block
table `width` wide:
  [ids | positions | slots | row_seq | limit | end | tree]  each `padded` long,
  then the block tables, `width` per sequence.
Rows past the step's own are padding: token 0 at position 0, K/V slot -1 (written
nowhere), no keys (end 0). A CUDA graph is captured over the views of a static buffer
for its bucket; an eager step packs a buffer of its own sizes. Either way the kernels
read the same fields."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specd.kvcache import BlockAllocator
from specd.models.attention import visibility
from specd.models.batch_plan import append_all, step_rows
from specd.models.seq_input import SeqInput

FIELDS = 7
PAD = (0, 0, -1, 0, 0, 0, 0)  # a padding row's value of each field


@dataclass
class HostRows:
    """One step's rows, on the host (built by `HostRows.build`)."""

    fields: list[list[int]]  # FIELDS lists of `rows` values, in the layout's order
    tables: list[list[int]]  # each sequence's block table as far as the step reaches
    logits_rows: list[int]  # rows whose logits the caller wants, in batch order

    @property
    def rows(self) -> int:
        return len(self.fields[0])

    @property
    def width(self) -> int:
        return max(len(t) for t in self.tables)

    @classmethod
    def build(cls, allocator: BlockAllocator, seqs: list[SeqInput]) -> HostRows:
        """Append every sequence's tokens to the allocator (all or nothing) and lay out
        the step's rows."""
        spans = append_all(allocator, seqs)
        ids, positions, logits_rows, _, slots, tables = step_rows(allocator, seqs, spans, 0)
        ancestries = [None if s.parents is None else s.ancestry() for s in seqs]
        seq_rows, limit, tree = visibility(spans, ancestries)
        row_seq = [b for b in range(len(seqs)) for _ in range(seq_rows[b + 1] - seq_rows[b])]
        end = [lim + (t % (1 << 64)).bit_length() for lim, t in zip(limit, tree, strict=True)]
        return cls([ids, positions, slots, row_seq, limit, end, tree], tables, logits_rows)

    def pack(self, padded: int, width: int, out: np.ndarray | None = None) -> np.ndarray:
        """The int64 buffer of the layout above, sized for `padded` rows and block tables
        `width` wide (a table past `width` is an error), written into `out` where given:
        its table entries past each table's end are left as they were (never read)."""
        n, rows = self.rows, self.fields
        size = StepInputs.size(padded, len(self.tables), width)
        buf = np.zeros(size, dtype=np.int64) if out is None else out[:size]
        for f, (values, pad) in enumerate(zip(rows, PAD, strict=True)):
            buf[f * padded : f * padded + n] = values
            buf[f * padded + n : (f + 1) * padded] = pad
        base = FIELDS * padded
        for b, table in enumerate(self.tables):
            if len(table) > width:
                raise ValueError(f"a block table of {len(table)} blocks is past {width}")
            buf[base + b * width : base + b * width + len(table)] = table
        return buf


@dataclass
class StepInputs:
    """The kernels' view of a packed buffer."""

    ids: torch.Tensor  # [padded]
    positions: torch.Tensor
    slots: torch.Tensor
    row_seq: torch.Tensor
    limit: torch.Tensor
    end: torch.Tensor
    tree: torch.Tensor
    table: torch.Tensor  # [sequences, width]

    @classmethod
    def view(cls, buffer: torch.Tensor, padded: int, sequences: int, width: int) -> StepInputs:
        parts = buffer[: FIELDS * padded].view(FIELDS, padded).unbind(0)
        table = buffer[FIELDS * padded : FIELDS * padded + sequences * width]
        return cls(*parts, table.view(sequences, width))

    @staticmethod
    def size(padded: int, sequences: int, width: int) -> int:
        return FIELDS * padded + sequences * width
