// The CPU kernels' entry points, shared by the Python bindings and the decoder stack.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

at::Tensor qlinear(const at::Tensor& x, const at::Tensor& records, const at::Tensor& bias,
                   int64_t bits, at::ScalarType out_dtype);
// matrices side by side (a fused matrix's parts of different widths): x quantised once
at::Tensor qlinear_parts(const at::Tensor& x, const std::vector<at::Tensor>& records,
                         const std::vector<int64_t>& bits, const at::Tensor& bias,
                         at::ScalarType out_dtype);
// fp32 x [M, K] @ w [N, K]^T (w fp32, bf16 or fp16), each row summed in one order
// whatever M (dense_linear.cpp)
at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& w);
int64_t activation_block(int64_t bits);   // qlinear.cpp: activations' block along K for a width
bool amx_available();                      // qlinear.cpp: AMX granted to this process
int64_t set_amx_min_rows(int64_t rows);    // calls of this many rows or more use it (0: never)
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                           const at::Tensor& table, int64_t block_size, const at::Tensor& seq_rows,
                           const at::Tensor& limit, const at::Tensor& tree, double scale);
at::Tensor add_rms_norm(at::Tensor x, const at::Tensor& residual, const at::Tensor& w, double eps);
// Qwen3: each query and each key head of qkv [T, (nh + 2 nkv) D] RMS-normed over its D
// (add_rms_norm's rows, weights q_w and k_w [D]); -> a new qkv, v as it was
at::Tensor qk_norm(const at::Tensor& qkv, const at::Tensor& q_w, const at::Tensor& k_w, int64_t heads,
                   int64_t kv_heads, double eps);
at::Tensor rope_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                      at::Tensor k_pool, at::Tensor v_pool, const at::Tensor& slots,
                      int64_t nh, int64_t nkv);
at::Tensor silu_mul(const at::Tensor& gate_up);
