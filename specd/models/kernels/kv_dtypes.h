// The (activations, K/V pool) dtype pairs that the K/V write and the attention take: one
// dtype, or a 16-bit cache under fp32 activations (specd.models.paged_kv.kv_dtype).
#pragma once

#include <ATen/core/Tensor.h>

inline void check_kv_dtypes(at::ScalarType act, const at::Tensor& k_pool, const at::Tensor& v_pool) {
  const auto kt = k_pool.scalar_type();
  TORCH_CHECK(act == at::kFloat || act == at::kBFloat16, "activations must be fp32 or bf16");
  TORCH_CHECK(v_pool.scalar_type() == kt, "the K and V pools must have one dtype");
  TORCH_CHECK(kt == act || (act == at::kFloat && (kt == at::kHalf || kt == at::kBFloat16)),
              "the pools must have the activations' dtype, or be fp16 / bf16 under fp32 ones");
}

// f(T(), KV()): the C++ types of a checked pair
template <typename F>
inline void with_kv_dtypes(at::ScalarType act, at::ScalarType kv, F&& f) {
  if (act == at::kBFloat16)
    f(at::BFloat16(), at::BFloat16());
  else if (kv == at::kHalf)
    f(float(), at::Half());
  else if (kv == at::kBFloat16)
    f(float(), at::BFloat16());
  else
    f(float(), float());
}
