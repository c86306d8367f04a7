"""One forward of a Llama-family model on a GPU (`GpuStep`): the layer loop over the Triton
kernels and the fixed-tile GEMMs, run eagerly for prefill and for any step past the
captured sizes, or replayed from a CUDA graph (specd.models.gpu.graphs) for decode and
verification. Both run the same kernels on the same shapes, so a row comes out the same
bits either way, and the same as it would alone (see row_gemm and triton_attention)."""

from __future__ import annotations

import torch

from specd.models import layer_ops
from specd.models.gpu import row_gemm, triton_attention, triton_layer_ops
from specd.models.gpu.row_gemm import padded, row_linear
from specd.models.gpu.step_inputs import HostRows, StepInputs
from specd.models.seq_input import SeqInput

SPLIT_KEYS = 256  # key positions per attention split (a constant: see triton_attention)


class GpuStep:
    def __init__(self, model, tile: int = row_gemm.TILE, split_keys: int = SPLIT_KEYS):
        """`tile`: rows per GEMM (0: one GEMM of the step's own rows, not batch-invariant)."""
        self.model = model
        self.tile = tile
        self.split_keys = split_keys
        self.graphs = None  # specd.models.gpu.graphs.StepGraphs, once captured for a cache

    @property
    def invariant(self) -> bool:
        """Is every row computed on its own, the same whatever else the step holds?"""
        return self.tile > 0

    def padded(self, rows: int) -> int:
        return padded(rows, self.tile) if self.tile else rows

    def max_keys(self, kv) -> int:
        """Key positions a sequence can reach: the model's context, within the pool."""
        pool = kv.allocator.num_blocks * kv.allocator.block_size
        return min(self.model.args.max_position_embeddings, pool)

    def forward(self, kv, seqs: list[SeqInput]) -> torch.Tensor:
        """As LlamaModel.forward: fp32 logits [R, V] for each sequence's last num_logits."""
        host = HostRows.build(kv.allocator, seqs)
        graphs = self.graphs
        wanted = torch.tensor(host.logits_rows, dtype=torch.long).to(self.model.device)
        if graphs is not None and graphs.kv is kv and graphs.fits(host):
            return graphs.replay(host).index_select(0, wanted).float()
        return self.eager(kv, host, wanted).float()

    def eager(self, kv, host: HostRows, wanted: torch.Tensor) -> torch.Tensor:
        """The step run as it comes -> logits [len(wanted), V] of the `wanted` rows, in
        their order."""
        pad, width = self.padded(host.rows), host.width
        buffer = torch.from_numpy(host.pack(pad, width)).to(self.model.device)
        inputs = StepInputs.view(buffer, pad, len(host.tables), width)
        return self.run(kv, inputs, host.rows, wanted=wanted)[: len(wanted)]

    def run(
        self,
        kv,
        inputs: StepInputs,
        rows: int,
        out: torch.Tensor | None = None,
        wanted: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The layers over `inputs` (laid out with `padded` rows, the first `rows` real)
        -> logits [padded, V] in the activations' dtype (into `out` where given). With
        `wanted` (row indices) the head reads only those rows, laid out as the step's are
        -> [padded(len(wanted)), V]: a prefill chunk wants its last row or none, and the
        head is the largest matrix, read again for each tile of rows."""
        m, a = self.model, self.model.args
        ops, eps = triton_layer_ops, a.rms_norm_eps
        keys = self.max_keys(kv)
        cos, sin = m.rope_table(keys)
        x = m.embed.index_select(0, inputs.ids)  # [padded, H]
        mlp = None  # the last layer's MLP output, not yet added to x
        for i, layer in enumerate(m.layers):
            h = ops.add_rms_norm(x, mlp, layer.attn_norm, eps, rows)
            qkv, bias = self.linear(h, layer.wqkv), layer.bqkv
            if layer.q_norm is not None:  # Qwen3: the bias, then the heads' norms, in torch
                qkv = qkv if bias is None else qkv + bias
                qkv = layer_ops.qk_norm(
                    qkv, layer.q_norm, layer.k_norm, a.num_heads, a.num_kv_heads, eps
                )
                bias = None
            q = ops.rope_store(
                qkv, bias, cos, sin, inputs.positions, inputs.slots, kv.k[i], kv.v[i],
                a.num_heads, a.num_kv_heads, rows,
            )  # fmt: skip
            o = triton_attention.paged_attention(
                q, kv.k[i], kv.v[i], inputs.table, inputs.row_seq, inputs.limit, inputs.end,
                inputs.tree, kv.allocator.block_size, self.split_keys, rows,
            )  # fmt: skip
            attn = self.linear(o.view(o.shape[0], -1), layer.wo, layer.bo)
            h = ops.add_rms_norm(x, attn, layer.mlp_norm, eps, rows)
            mlp = self.linear(ops.silu_mul(self.linear(h, layer.w_gate_up), rows), layer.w_down)
        h = ops.add_rms_norm(x, mlp, m.norm, eps, rows)
        if wanted is not None:
            if not len(wanted):
                return h.new_empty(0, m.lm_head.shape[0])
            picked = h.new_zeros(self.padded(len(wanted)), h.shape[1])
            picked[: len(wanted)] = h.index_select(0, wanted)
            h = picked
        return self.linear(h, m.lm_head, out=out)

    def linear(self, x, w, b=None, out=None):
        if self.tile:
            y = row_linear(x, w, self.tile, out)
        else:
            y = torch.mm(x, w.t(), out=out) if out is not None else torch.mm(x, w.t())
        if b is not None:
            y += b
        return y
