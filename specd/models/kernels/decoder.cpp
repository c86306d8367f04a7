// DecoderStack (decoder.h): the layers' loop, as specd/models/llama.py runs it.

#include "decoder.h"

#include <ATen/ops/empty.h>

namespace decoder {

at::Tensor Linear::operator()(const at::Tensor& x) const {
  const auto dtype = x.scalar_type();
  if (records.size() == 1)
    return qlinear(x, records[0], bias, bits[0], dtype);
  auto y = qlinear_parts(x, records, bits, at::Tensor(), dtype);
  return bias.defined() ? y.add_(bias.to(dtype)) : y;
}

namespace {

Linear make_linear(const std::vector<at::Tensor>& records, const std::vector<int64_t>& bits,
                   const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(!records.empty() && records.size() == bits.size(), "a linear needs its records and bits");
  Linear l{records, bits, at::Tensor()};
  if (bias.has_value() && bias->defined())
    l.bias = records.size() == 1 ? bias->to(at::kFloat).contiguous() : *bias;
  return l;
}

}  // namespace
}  // namespace decoder

void DecoderStack::add_layer(const at::Tensor& attn_norm, const at::Tensor& mlp_norm,
                             const std::vector<at::Tensor>& qkv, const std::vector<int64_t>& qkv_bits,
                             const c10::optional<at::Tensor>& qkv_bias, const std::vector<at::Tensor>& o,
                             const std::vector<int64_t>& o_bits, const c10::optional<at::Tensor>& o_bias,
                             const std::vector<at::Tensor>& gate_up, const std::vector<int64_t>& gate_up_bits,
                             const std::vector<at::Tensor>& down, const std::vector<int64_t>& down_bits,
                             const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm) {
  using decoder::make_linear;
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "query and key norms come together");
  layers_.push_back(decoder::Layer{attn_norm, mlp_norm, make_linear(qkv, qkv_bits, qkv_bias),
                                   make_linear(o, o_bits, o_bias), make_linear(gate_up, gate_up_bits, {}),
                                   make_linear(down, down_bits, {}), q_norm.value_or(at::Tensor()),
                                   k_norm.value_or(at::Tensor())});
}

at::Tensor DecoderStack::forward(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                                 const std::vector<at::Tensor>& k_pools,
                                 const std::vector<at::Tensor>& v_pools, const at::Tensor& slots,
                                 const at::Tensor& table, int64_t block_size,
                                 const at::Tensor& seq_rows, const at::Tensor& limit,
                                 const at::Tensor& tree, double scale) const {
  TORCH_CHECK(k_pools.size() == layers_.size() && v_pools.size() == layers_.size(),
              "one K and one V pool per layer");
  const at::Tensor none = at::empty({0}, x.options());
  at::Tensor mlp;
  for (size_t i = 0; i < layers_.size(); ++i) {
    const decoder::Layer& l = layers_[i];
    at::Tensor h = add_rms_norm(x, mlp.defined() ? mlp : none, l.attn_norm, eps_);
    at::Tensor qkv = l.qkv(h).contiguous();
    if (l.q_norm.defined()) qkv = qk_norm(qkv, l.q_norm, l.k_norm, heads_, kv_heads_, eps_);
    const at::Tensor q = rope_store(qkv, cos, sin, k_pools[i], v_pools[i], slots, heads_, kv_heads_);
    const at::Tensor out = paged_attention(q.contiguous(), k_pools[i], v_pools[i], table, block_size,
                                           seq_rows, limit, tree, scale);
    const at::Tensor attn = l.o(out.view({-1, heads_ * head_dim_}));
    h = add_rms_norm(x, attn.contiguous(), l.mlp_norm, eps_);
    mlp = l.down(silu_mul(l.gate_up(h)));
  }
  return mlp.defined() ? x.add(mlp) : x;
}
