"""Decode and verification steps replayed from CUDA graphs, captured at start.

A graph is captured per bucket of rows (1, 2, 4, 8, then every 16 up to `max_rows`), over
the views of one static input buffer (specd.models.gpu.step_inputs) with room for
`max_seqs` block tables of a full context each. A step of up to `max_rows` rows of up to
`max_seqs` sequences (decode: 1 row a sequence; verification: k + 1 and the tree's
leaves; a short prefill chunk) replays the smallest bucket that holds it with its rows
packed into the buffer, the rest padding; a graph computes every row's logits and the
step keeps those it wants. Longer prefill chunks and larger batches run eagerly. The
graphs share one memory pool (captured largest first, as vLLM and nano-vllm do) and
write their logits into one static buffer: a step reads its logits before the next
replays. Without CUDA (`capture=False`) the same buckets and buffers run eagerly, which
is how the tests check them on a CPU.
"""

from __future__ import annotations

import logging
import time

import torch

from specd.models.gpu.step_inputs import FIELDS, HostRows, StepInputs

log = logging.getLogger(__name__)


def buckets(max_rows: int) -> list[int]:
    """The captured row counts: 1, 2, 4, 8, then every 16, up to max_rows."""
    out = [b for b in (1, 2, 4, 8) if b < max_rows]
    out += list(range(16, max_rows, 16))
    return out + [max_rows]


class StepGraphs:
    def __init__(self, step, kv, max_seqs: int, max_rows: int, capture: bool = True):
        self.step, self.kv = step, kv
        self.max_seqs, self.max_rows = max_seqs, max_rows
        self.width = -(-step.max_keys(kv) // kv.allocator.block_size)  # blocks a table holds
        self.sizes = buckets(max_rows)
        device = step.model.device
        largest = step.padded(self.sizes[-1])
        self.buffer = torch.zeros(
            StepInputs.size(largest, max_seqs, self.width), dtype=torch.int64, device=device
        )
        self.staging = torch.zeros_like(self.buffer, device="cpu")
        # on CUDA, recorded after each step's copy: the forward returns before it ran
        self._copied = None
        if device.type == "cuda":
            self.staging = self.staging.pin_memory()
            self._copied = torch.cuda.Event()
        HostRows([[]] * FIELDS, [], []).pack(largest, 0, self.staging.numpy())  # all padding
        self.buffer.copy_(self.staging)
        # the RoPE table the graphs read: held here, so a later, longer table built for
        # another cache cannot free what they point at
        self.rope = step.model.rope_table(step.max_keys(kv))
        vocab = step.model.lm_head.shape[0]
        self.logits = torch.empty(largest, vocab, dtype=step.model.dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph | None] = {}
        self.capture_s = 0.0
        self.memory = 0
        self._capture(capture and device.type == "cuda")

    def fits(self, host: HostRows) -> bool:
        """Can this step replay a graph? (rows and sequences within the buckets; a short
        prefill chunk or a drafter's catch-up too: their logits are chosen after)"""
        fits = host.rows <= self.max_rows and len(host.tables) <= self.max_seqs
        return fits and host.width <= self.width

    def bucket(self, rows: int) -> int:
        return next(b for b in self.sizes if b >= rows)

    def replay(self, host: HostRows) -> torch.Tensor:
        """Run the step in its bucket -> logits [padded, V] (a view of the static buffer)."""
        size = self.bucket(host.rows)
        pad = self.step.padded(size)
        if self._copied is not None:  # the last step's copy has read the staging rows
            self._copied.synchronize()
        n = host.pack(pad, self.width, self.staging.numpy()).size
        self.buffer[:n].copy_(self.staging[:n], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        graph = self.graphs[size]
        if graph is None:  # not captured (no CUDA): the same kernels over the same views
            self._run(size)
        else:
            graph.replay()
        return self.logits[:pad]

    def _run(self, size: int) -> None:
        pad = self.step.padded(size)
        inputs = StepInputs.view(self.buffer, pad, self.max_seqs, self.width)
        self.step.run(self.kv, inputs, size, out=self.logits[:pad])

    def _capture(self, on_cuda: bool) -> None:
        if not on_cuda:
            self.graphs = dict.fromkeys(self.sizes)
            return
        start, before = time.perf_counter(), torch.cuda.memory_reserved()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # every bucket's kernels compiled outside any capture
            for size in self.sizes:  # (Triton specialises on its views' alignments too)
                self._run(size)
        torch.cuda.current_stream().wait_stream(stream)
        for size in reversed(self.sizes):  # largest first: the pool grows once
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._run(size)
            self.graphs[size] = graph
        torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - start
        self.memory = torch.cuda.memory_reserved() - before
        log.info(
            "CUDA graphs: %d buckets of 1-%d rows (%d sequences) captured in %.1f s, %.0f MiB",
            len(self.sizes), self.max_rows, self.max_seqs, self.capture_s, self.memory / 2**20,
        )  # fmt: skip
