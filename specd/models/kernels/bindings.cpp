// The CPU kernels' Python module (built by specd/models/native.py::kernel).
//
// pybind11 with torch's casters (Tensor, dtype, optional), not torch/extension.h: that
// adds torch's whole C++ frontend, three times this file's compile. The kernels' own
// sources include ATen's Tensor alone.

#include <torch/csrc/utils/pybind.h>

#include "decoder.h"
#include "ops.h"

// The calls that run for a while (a forward's matrices and attention, the layer stack)
// let go of the GIL, so a service's event loop goes on serving while the model thread
// computes (verifier_service/frontend.py); the short element-wise ones keep it.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("qlinear", &qlinear, "group-quantised linear (AVX512-VNNI or AVX2)", release());
  m.def("qlinear_parts", &qlinear_parts, "qlinear of matrices side by side, x quantised once", release());
  m.def("dense_linear", &dense_linear, "fp32 linear over fp32, bf16 or fp16 weights, a row's sums in one order whatever the rows (AVX2)", release());
  m.def("activation_block", &activation_block, "the block along K of one activation scale, for weights of this width");
  m.def("amx_available", &amx_available, "whether qlinear may use AMX in this process");
  m.def("set_amx_min_rows", &set_amx_min_rows, "qlinear calls of this many rows use AMX (0: never); -> the old value");
  m.def("paged_attention", &paged_attention, "attention over a paged K/V cache (AVX512 or AVX2)", release());
  m.def("add_rms_norm", &add_rms_norm, "x += residual (in place), then RMSNorm");
  m.def("qk_norm", &qk_norm, "each query and key head RMS-normed (Qwen3); -> a new qkv");
  m.def("rope_store", &rope_store, "RoPE on q and k, k and v into the paged pools; -> q");
  m.def("silu_mul", &silu_mul, "silu(gate) * up");
  pybind11::class_<DecoderStack>(m, "DecoderStack")
      .def(pybind11::init<int64_t, int64_t, int64_t, double>())
      .def("add_layer", &DecoderStack::add_layer)
      .def("forward", &DecoderStack::forward, release())
      .def("__len__", &DecoderStack::size);
}
