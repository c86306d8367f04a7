// The CPU kernels' Python module (built by specd/models/native.py::kernel).

#include <torch/extension.h>

at::Tensor qlinear(const at::Tensor& x, const at::Tensor& records, const at::Tensor& bias,
                   int64_t bits, at::ScalarType out_dtype);
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                           const at::Tensor& table, int64_t block_size, const at::Tensor& seq_rows,
                           const at::Tensor& limit, const at::Tensor& tree, double scale);
at::Tensor add_rms_norm(at::Tensor x, const at::Tensor& residual, const at::Tensor& w, double eps);
at::Tensor rope_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                      at::Tensor k_pool, at::Tensor v_pool, const at::Tensor& slots,
                      int64_t nh, int64_t nkv);
at::Tensor silu_mul(const at::Tensor& gate_up);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("qlinear", &qlinear, "group-quantised linear (AVX512-VNNI or AVX2)");
  m.def("paged_attention", &paged_attention, "attention over a paged K/V cache (AVX512 or AVX2)");
  m.def("add_rms_norm", &add_rms_norm, "x += residual (in place), then RMSNorm");
  m.def("rope_store", &rope_store, "RoPE on q and k, k and v into the paged pools; -> q");
  m.def("silu_mul", &silu_mul, "silu(gate) * up");
}
