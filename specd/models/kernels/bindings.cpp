// The CPU kernels' Python module (built by specd/models/native.py::kernel).

#include <torch/extension.h>

at::Tensor qlinear(const at::Tensor& x, const at::Tensor& records, const at::Tensor& bias,
                   int64_t bits, at::ScalarType out_dtype);
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                           const at::Tensor& table, int64_t block_size, const at::Tensor& seq_rows,
                           const at::Tensor& limit, const at::Tensor& tree, double scale);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("qlinear", &qlinear, "group-quantised linear (AVX512-VNNI or AVX2)");
  m.def("paged_attention", &paged_attention, "attention over a paged K/V cache (AVX512 or AVX2)");
}
