// Every decoder layer of one step in a single native call, for a model whose matrices are
// all group-quantised and whose attention reads the paged pool in place (the CPU path).
// The calls and their order are those of specd/models/llama.py's loop, so the results are
// the same bits; what goes is the per-layer Python (1-4% of a step of the 1.5B, 3-7% of
// the 0.5B drafter's: docs/benchmarks-log.md section 32). `DecoderStack` holds the weights, built
// once per model.

#pragma once

#include "ops.h"

#include <vector>

namespace decoder {

// One linear: a fused matrix (its bias, fp32, added by the kernel), or parts of different
// bit widths whose outputs sit side by side and then take the bias in the activations'
// dtype (specd.models.matmul.linear's two cases).
struct Linear {
  std::vector<at::Tensor> records;
  std::vector<int64_t> bits;
  at::Tensor bias;  // undefined: none

  at::Tensor operator()(const at::Tensor& x) const;
};

struct Layer {
  at::Tensor attn_norm, mlp_norm;
  Linear qkv, o, gate_up, down;
  at::Tensor q_norm, k_norm;  // Qwen3's, [head_dim] (undefined: none)
};

}  // namespace decoder

class DecoderStack {
 public:
  DecoderStack(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), eps_(eps) {}

  // one layer, in order: its norms, then each linear as (records, bits, bias)
  void add_layer(const at::Tensor& attn_norm, const at::Tensor& mlp_norm,
                 const std::vector<at::Tensor>& qkv, const std::vector<int64_t>& qkv_bits,
                 const c10::optional<at::Tensor>& qkv_bias, const std::vector<at::Tensor>& o,
                 const std::vector<int64_t>& o_bits, const c10::optional<at::Tensor>& o_bias,
                 const std::vector<at::Tensor>& gate_up, const std::vector<int64_t>& gate_up_bits,
                 const std::vector<at::Tensor>& down, const std::vector<int64_t>& down_bits,
                 const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm);

  // x [T, hidden] (updated in place, as the Python loop does) -> the residual stream after
  // the last layer, before the final norm
  at::Tensor forward(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                     const std::vector<at::Tensor>& k_pools, const std::vector<at::Tensor>& v_pools,
                     const at::Tensor& slots, const at::Tensor& table, int64_t block_size,
                     const at::Tensor& seq_rows, const at::Tensor& limit, const at::Tensor& tree,
                     double scale) const;

  int64_t size() const { return int64_t(layers_.size()); }

 private:
  int64_t heads_, kv_heads_, head_dim_;
  double eps_;
  std::vector<decoder::Layer> layers_;
};
