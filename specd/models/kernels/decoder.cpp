// Every decoder layer of one step in a single native call, for a model whose matrices are
// all group-quantised and whose attention reads the paged pool in place (the CPU path).
// The calls and their order are those of specd/models/llama.py's loop, so the results are
// the same bits; what goes is the per-layer Python (1-4% of a step of the 1.5B, 3-7% of
// the 0.5B drafter's: docs/benchmarks-log.md section 32). `DecoderStack` holds the weights, built
// once per model.

#include "ops.h"

#include <utility>
#include <vector>

namespace {

// One linear: a fused matrix (its bias, fp32, added by the kernel), or parts of different
// bit widths whose outputs sit side by side and then take the bias in the activations'
// dtype (specd.models.matmul.linear's two cases).
struct Linear {
  std::vector<at::Tensor> records;
  std::vector<int64_t> bits;
  at::Tensor bias;  // undefined: none

  at::Tensor operator()(const at::Tensor& x) const {
    const auto dtype = x.scalar_type();
    if (records.size() == 1)
      return qlinear(x, records[0], bias, bits[0], dtype);
    auto y = qlinear_parts(x, records, bits, at::Tensor(), dtype);
    return bias.defined() ? y.add_(bias.to(dtype)) : y;
  }
};

Linear make_linear(const std::vector<at::Tensor>& records, const std::vector<int64_t>& bits,
                   const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(!records.empty() && records.size() == bits.size(), "a linear needs its records and bits");
  Linear l{records, bits, at::Tensor()};
  if (bias.has_value() && bias->defined())
    l.bias = records.size() == 1 ? bias->to(at::kFloat).contiguous() : *bias;
  return l;
}

struct Layer {
  at::Tensor attn_norm, mlp_norm;
  Linear qkv, o, gate_up, down;
};

}  // namespace

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
                 const std::vector<at::Tensor>& down, const std::vector<int64_t>& down_bits) {
    layers_.push_back(Layer{attn_norm, mlp_norm, make_linear(qkv, qkv_bits, qkv_bias),
                            make_linear(o, o_bits, o_bias), make_linear(gate_up, gate_up_bits, {}),
                            make_linear(down, down_bits, {})});
  }

  // x [T, hidden] (updated in place, as the Python loop does) -> the residual stream after
  // the last layer, before the final norm
  at::Tensor forward(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                     const std::vector<at::Tensor>& k_pools, const std::vector<at::Tensor>& v_pools,
                     const at::Tensor& slots, const at::Tensor& table, int64_t block_size,
                     const at::Tensor& seq_rows, const at::Tensor& limit, const at::Tensor& tree,
                     double scale) const {
    TORCH_CHECK(k_pools.size() == layers_.size() && v_pools.size() == layers_.size(),
                "one K and one V pool per layer");
    const at::Tensor none = at::empty({0}, x.options());
    at::Tensor mlp;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& l = layers_[i];
      at::Tensor h = add_rms_norm(x, mlp.defined() ? mlp : none, l.attn_norm, eps_);
      const at::Tensor qkv = l.qkv(h).contiguous();
      const at::Tensor q = rope_store(qkv, cos, sin, k_pools[i], v_pools[i], slots, heads_, kv_heads_);
      const at::Tensor out = paged_attention(q.contiguous(), k_pools[i], v_pools[i], table, block_size,
                                             seq_rows, limit, tree, scale);
      const at::Tensor attn = l.o(out.view({-1, heads_ * head_dim_}));
      h = add_rms_norm(x, attn.contiguous(), l.mlp_norm, eps_);
      mlp = l.down(silu_mul(l.gate_up(h)));
    }
    return mlp.defined() ? x + mlp : x;
  }

  int64_t size() const { return int64_t(layers_.size()); }

 private:
  int64_t heads_, kv_heads_, head_dim_;
  double eps_;
  std::vector<Layer> layers_;
};

void bind_decoder(pybind11::module& m) {
  pybind11::class_<DecoderStack>(m, "DecoderStack")
      .def(pybind11::init<int64_t, int64_t, int64_t, double>())
      .def("add_layer", &DecoderStack::add_layer)
      .def("forward", &DecoderStack::forward, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("__len__", &DecoderStack::size);
}
