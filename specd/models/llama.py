"""One Llama-family forward (Llama 3.x, Qwen2 with QKV bias, Qwen3 with its query and key
norms, Mistral, SmolLM) over a paged KV cache, for a batch of sequences with different
query lengths in one call.

Per layer: RMSNorm -> fused QKV (+bias) -> (Qwen3: each head's RMSNorm) -> RoPE -> write
K/V to their slots -> GQA attention over each sequence's cached + new keys -> O ->
residual -> RMSNorm -> fused gate/up -> SiLU(gate) * up -> down -> residual.
Activations stay flat `[T, hidden]` (T = all new tokens of the batch, no padding).
Attention reads the K/V pool in place (specd.models.attention's kernel, one query row at
a time, prefill chunks included); a tree wider than its kernel takes, or a device without
the kernel, gathers keys and pads queries for SDPA. The element-wise parts (residual +
RMSNorm, RoPE + K/V write, SiLU * up) are specd.models.layer_ops: one native call each on
a CPU with the kernels. There, with every matrix quantised and attention paged, all the
layers of a step run in one native call (specd.models.decoder_stack) that makes the
loop's calls in its order (not for Qwen3's norms, which only the loop applies).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specd.config import INVARIANT_TILE
from specd.models import attention, decoder_stack, layer_ops
from specd.models.args import ModelArgs
from specd.models.batch_plan import BatchPlan
from specd.models.matmul import linear
from specd.models.paged_kv import PagedKV, kv_dtype
from specd.models.qlinear import QWeight, quantize
from specd.models.row_cache import RowCache
from specd.models.seq_input import SeqInput

log = logging.getLogger(__name__)

# the RoPE table is built in blocks of this many positions: each block's ops then run on
# one thread (under ATen's grain), every value in the same vector code as a step's own
# [T, head_dim] rows, so the table holds the values a step would compute
ROPE_BLOCK = 128


@dataclass
class Layer:
    attn_norm: torch.Tensor  # [H]
    wqkv: torch.Tensor  # [(n_heads + 2 * n_kv) * head_dim, H]
    bqkv: torch.Tensor | None
    wo: torch.Tensor  # [H, n_heads * head_dim]
    bo: torch.Tensor | None
    mlp_norm: torch.Tensor  # [H]
    w_gate_up: torch.Tensor  # [2 * I, H]
    w_down: torch.Tensor  # [H, I]
    # Qwen3: an RMSNorm over each query and each key head before RoPE, [head_dim] each
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None


class LlamaModel:
    def __init__(
        self,
        args: ModelArgs,
        embed,
        layers,
        norm,
        lm_head,
        inv_freq,
        rope_scale,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.args = args
        self.embed = embed  # [V, H]
        self.layers: list[Layer] = layers
        self.norm = norm  # [H]
        self.lm_head = lm_head  # [V, H] (the embedding itself when tied)
        self.inv_freq = inv_freq.to(device)  # [head_dim / 2] fp32
        self.rope_scale = rope_scale
        self.dtype = dtype
        self.kv_dtype = kv_dtype("auto", dtype)  # the K/V pools' (specd.models.paged_kv)
        self.device = device
        self.batch_invariant = False  # see specd.models.matmul
        self.head_ids: torch.Tensor | None = None  # set by trim_head
        self.weights = "bf16"  # format of the matrices (specd.models.weights)
        self._paged: bool | None = None  # can steps use specd.models.attention's kernel?
        self._native_ops = layer_ops.available(device, dtype)  # specd.models.layer_ops
        self._stack = None  # specd.models.decoder_stack's, built at the first paged step
        self._embed_rows: RowCache | None = None  # a quantised embedding's recent rows
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin by position
        # on CUDA, the step of specd.models.gpu (Triton kernels, graphs once prepared)
        self.gpu = gpu_step(self) if device.type == "cuda" else None
        # does `forward` return with its kernels queued, the device still at them (a
        # GPU's)? Then its logits are ready after `synchronize`, and the caller's
        # Python may run while the device computes
        self.queued = device.type == "cuda"

    def _linear(self, x, w, b=None):
        return linear(x, w, b, invariant=self.batch_invariant)

    # -- public API ----------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, kv: PagedKV, seqs: list[SeqInput]) -> torch.Tensor:
        """Run new tokens of several sequences; returns fp32 logits [R, V] where R is the
        sum of `num_logits`, in batch order. Appends the tokens to `kv.allocator`."""
        if self.gpu is not None:
            return self.gpu.forward(kv, seqs)
        tile = INVARIANT_TILE if self.batch_invariant else 0
        if self._paged is None:
            self._paged = attention.available(self.device, self.dtype, self.args.head_dim)
        plan = BatchPlan.build(kv.allocator, seqs, self.device, q_tile=tile, paged=self._paged)
        hidden = self.hidden_states(kv, plan)
        if plan.logits_index.numel() == 0:
            width = self.args.vocab_size if self.head_ids is None else len(self.head_ids)
            return hidden.new_zeros((0, width), dtype=torch.float32)
        return self.logits(hidden.index_select(0, plan.logits_index))

    def synchronize(self) -> None:
        """Wait, the GIL released, until the device has run what `forward` queued."""
        if self.queued:
            torch.cuda.current_stream(self.device).synchronize()

    def chunk_invariant(self) -> bool:
        """Does every number of a token come out the same however its context was split
        into forwards? True when every matrix runs in the integer kernel (a row's result
        never depends on the other rows) and attention in the paged kernel (one query row
        at a time): then a prefix taken from the cache gives the logits that computing it
        would, bit for bit (specd.kvcache's prefix cache is on by default only then).
        On a GPU: when its step runs fixed-tile GEMMs (specd.models.gpu.row_gemm)."""
        if self.gpu is not None:
            return self.gpu.invariant
        mats = [self.lm_head]
        for layer in self.layers:
            mats += [layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down]
        parts = [p for m in mats for p in (m if isinstance(m, list) else [m])]
        quantised = all(isinstance(p, QWeight) for p in parts)
        return quantised and attention.available(self.device, self.dtype, self.args.head_dim)

    def prepare_steps(self, kv: PagedKV, max_seqs: int, max_rows: int, graphs=True) -> None:
        """Capture the decode/verification steps of up to `max_seqs` sequences and
        `max_rows` rows over `kv` as CUDA graphs (specd.models.gpu.graphs); nothing
        where the model has no GPU step, or without `graphs` (every step eager)."""
        if self.gpu is not None and graphs:
            from specd.models.gpu.graphs import StepGraphs

            self.gpu.graphs = StepGraphs(self.gpu, kv, max_seqs, max_rows)

    def trim_head(self, keep: torch.Tensor, bits: int | None = None) -> None:
        """Score only the token ids in `keep` [V'] (a drafter's trimmed head): logits come
        back as [R, V'] in `keep`'s order; `self.head_ids` maps a column to its token id.
        A quantised head keeps its rows' codes (exact), or with `bits` is quantised again
        at that width where it has another."""
        head = self.lm_head
        if isinstance(head, QWeight):  # the kept rows' codes, repacked (exact)
            head = head.take_rows(keep)
            if bits is not None and head.bits != bits:
                head = quantize(head.dequantize(torch.float32), bits)
            self.lm_head = head
        else:
            self.lm_head = head[keep].contiguous()
        self.head_ids = keep.to(self.device)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head for selected rows [R, H] -> fp32 [R, V] (V' if trimmed)."""
        eps = self.args.rms_norm_eps
        if self._native_ops:  # one call, as the layers' norms (torch's takes ~8 ops)
            _, h = layer_ops.add_rms_norm(hidden.contiguous(), None, self.norm, eps, True)
        else:
            h = layer_ops.rms_norm(hidden, self.norm, eps)
        return linear(h, self.lm_head, invariant=self.batch_invariant, out_dtype=torch.float32)

    def hidden_states(self, kv: PagedKV, plan: BatchPlan) -> torch.Tensor:
        if isinstance(self.embed, QWeight):
            if self._embed_rows is None or self._embed_rows.weight is not self.embed:
                self._embed_rows = RowCache(self.embed, self.dtype)  # built again if replaced
            x = self._embed_rows(plan.input_ids)  # [T, H]
        else:
            x = self.embed.index_select(0, plan.input_ids).to(self.dtype)  # (16-bit: fp32)
        cos, sin = self._rope(plan.positions, plan.end)
        if plan.paged is not None:  # every layer in one native call where it can
            if self._stack is None:
                self._stack = decoder_stack.build(self) or False
            if self._stack:
                return decoder_stack.run(self._stack, x, kv, plan, cos, sin, self.args.head_dim)
        eps, native = self.args.rms_norm_eps, self._native_ops
        mlp = None  # the last layer's MLP output, not yet added to x
        for i, layer in enumerate(self.layers):
            x, h = layer_ops.add_rms_norm(x, mlp, layer.attn_norm, eps, native)
            attn = self._attention(layer, h, kv.k[i], kv.v[i], plan, cos, sin)
            x, h = layer_ops.add_rms_norm(x, attn, layer.mlp_norm, eps, native)
            act = layer_ops.silu_mul(self._linear(h, layer.w_gate_up), native)
            mlp = self._linear(act, layer.w_down)
        return x + mlp  # [T, H], before the final norm

    # -- pieces --------------------------------------------------------------------------
    def _rope(self, positions: torch.Tensor, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, head_dim] at each row's position (all below `end`): rows of
        `rope_table`. Computed per step they took ~0.15 ms of a 0.5B drafter's ~9 ms
        forward."""
        cos, sin = self.rope_table(end)
        return cos.index_select(0, positions), sin.index_select(0, positions)

    def rope_table(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [positions, head_dim] for at least the positions below `end`: one
        table, built again twice as long when a step passes it (the GPU step reads it by
        position inside its kernels)."""
        size = 0 if self._rope_table is None else self._rope_table[0].shape[0]
        if size < end:
            size = max(end, 2 * size, ROPE_BLOCK)
            steps = torch.arange(size, device=self.device).split(ROPE_BLOCK)
            parts = [self._rope_rows(p) for p in steps]
            self._rope_table = tuple(torch.cat(t) for t in zip(*parts, strict=True))
        return self._rope_table

    def _rope_rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # [T, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, head_dim]
        cos = (emb.cos() * self.rope_scale).to(self.dtype)  # [T, head_dim]
        sin = (emb.sin() * self.rope_scale).to(self.dtype)
        return cos, sin

    def _attention(self, layer: Layer, x, k_pool, v_pool, plan: BatchPlan, cos, sin):
        a = self.args
        n_q, hd = a.num_heads * a.head_dim, a.head_dim
        qkv = self._linear(x, layer.wqkv, layer.bqkv)  # [T, n_q + 2 n_kv]
        if layer.q_norm is not None:
            qkv = layer_ops.qk_norm(
                qkv, layer.q_norm, layer.k_norm, a.num_heads, a.num_kv_heads, a.rms_norm_eps,
                self._native_ops,
            )  # fmt: skip
        q = layer_ops.rope_store(
            qkv, cos, sin, k_pool, v_pool, plan.write_slots, a.num_heads, a.num_kv_heads,
            self._native_ops,
        )  # fmt: skip
        if plan.paged is not None:  # read the pool in place
            out = attention.paged_attention(q, k_pool, v_pool, plan.paged)
            return self._linear(out.view(-1, n_q), layer.wo, layer.bo)
        keys = k_pool[plan.kv_slots].transpose(1, 2).to(q.dtype)  # [B, kv_heads, L_max, hd]
        values = v_pool[plan.kv_slots].transpose(1, 2).to(q.dtype)

        b, qm, group = plan.batch, plan.q_max, a.num_heads // a.num_kv_heads
        if plan.pad_index is None:  # one sequence: its T rows are its queries
            queries = q.view(1, -1, a.num_heads, hd)
        else:
            padded = q.new_zeros(b * qm, a.num_heads, hd)
            padded.index_copy_(0, plan.pad_index, q)
            queries = padded.view(b, qm, a.num_heads, hd)
        # GQA: query head h reads kv head h // group. Fold each kv head's group of query
        # heads into the query axis, [B, kv_heads, group * Q, hd], so attention sees equal
        # head counts and never materialises repeated keys.
        queries = queries.view(b, qm, a.num_kv_heads, group, hd).permute(0, 2, 3, 1, 4)
        queries = queries.reshape(b, a.num_kv_heads, group * qm, hd)
        mask = plan.attn_mask
        if mask is not None and group > 1:  # [B, 1, Q, L] -> [B, 1, group * Q, L]
            mask = mask.unsqueeze(2).expand(b, 1, group, qm, mask.shape[-1]).flatten(2, 3)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask)
        out = out.view(b, a.num_kv_heads, group, qm, hd).permute(0, 3, 1, 2, 4)  # [B,Q,kv,g,hd]
        out = out.reshape(b * qm, a.num_heads * hd)
        if plan.pad_index is not None:
            out = out.index_select(0, plan.pad_index)  # back to the flat [T, ...]
        return self._linear(out, layer.wo, layer.bo)


def gpu_step(model: LlamaModel):
    """The GPU step for a model on CUDA, where Triton imports (SPECD_NO_TRITON=1: none;
    the model then runs the torch path below, as on a CPU without the kernels)."""
    if os.environ.get("SPECD_NO_TRITON"):
        return None
    try:
        from specd.models.gpu.step import GpuStep
    except ImportError as e:
        log.warning("no Triton (%s): the GPU runs torch op by op, without graphs", e)
        return None
    return GpuStep(model)
