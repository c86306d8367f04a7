// The element-wise parts of a decoder layer, fused so that a decode step on a CPU is one
// native call each instead of the ~20 small torch ops (and their Python) they were: at one
// row those cost more than the matmuls' 12 ms a step left them (specd/models/llama.py).
//
// Every op rounds where the torch expression it replaces rounds (a bf16 op computes in
// fp32 and rounds once), so rope and the residual add are bitwise torch's; the RMSNorm's
// sum of squares runs in its own fixed order, the same for every row count, and SiLU
// takes its own exp (see silu_mul). Rows are
// independent and are split over threads only between rows: a row's result never depends
// on the other rows of the call (batch invariance, as for the matmul and the attention).

#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>

#include "bf16.h"
#include "exp_poly.h"
#include "kv_dtypes.h"

#include <cmath>
#include <cstdint>
#include <cstring>

// a * b + c * d must round twice, as torch's separate ops do (fp32 has no cast between
// them to keep the compiler from fusing them into an FMA)
#pragma GCC optimize("fp-contract=off")

namespace {

constexpr int64_t ROWS_PER_TASK = 8;

template <typename T>
inline float f32(T v) { return static_cast<float>(v); }

// x [T, H] (+= residual, rounded to x's dtype, in place) -> y = w * round(x * r),
// r = 1 / sqrt(mean(x^2) + eps), as specd.models.llama.rms_norm
template <typename T>
void add_rms_norm_rows(T* x, const T* res, const T* w, T* y, int64_t rows, int64_t H, float eps) {
  at::parallel_for(0, rows, ROWS_PER_TASK, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      T* xr = x + r * H;
      if (res) {
        const T* rr = res + r * H;
        for (int64_t i = 0; i < H; ++i) xr[i] = T(f32(xr[i]) + f32(rr[i]));
      }
      // 16 partial sums, added in a fixed order: vectorises, and the same for any row
      float part[16] = {};
      int64_t i = 0;
      for (; i + 16 <= H; i += 16)
        for (int j = 0; j < 16; ++j) part[j] += f32(xr[i + j]) * f32(xr[i + j]);
      for (; i < H; ++i) part[i % 16] += f32(xr[i]) * f32(xr[i]);
      float ss = 0.f;
      for (int j = 0; j < 16; ++j) ss += part[j];
      const float scale = 1.f / std::sqrt(ss / float(H) + eps);
      T* yr = y + r * H;
      for (int64_t k = 0; k < H; ++k) yr[k] = T(f32(w[k]) * f32(T(f32(xr[k]) * scale)));
    }
  });
}

// one head: out = round(round(v * cos) + round(rotate_half(v) * sin)), rounded to T and
// then to O (a K pool's dtype, T itself or a 16-bit cache under fp32 activations)
template <typename T, typename O = T>
inline void rope_head(const T* v, const T* cs, const T* sn, O* out, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < D; ++i) {
    const float rot = i < half ? -f32(v[i + half]) : f32(v[i - half]);
    out[i] = O(f32(T(f32(T(f32(v[i]) * f32(cs[i]))) + f32(T(rot * f32(sn[i]))))));
  }
}

template <typename T, typename KV>
void rope_store_rows(const T* qkv, const T* cs, const T* sn, KV* kp, KV* vp, const int64_t* slots,
                     T* q, int64_t rows, int64_t nh, int64_t nkv, int64_t D) {
  const int64_t width = (nh + 2 * nkv) * D;
  at::parallel_for(0, rows, ROWS_PER_TASK, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* row = qkv + r * width;
      const T* c = cs + r * D;
      const T* s = sn + r * D;
      for (int64_t h = 0; h < nh; ++h) rope_head(row + h * D, c, s, q + (r * nh + h) * D, D);
      KV* kd = kp + slots[r] * nkv * D;
      KV* vd = vp + slots[r] * nkv * D;
      for (int64_t h = 0; h < nkv; ++h) rope_head(row + (nh + h) * D, c, s, kd + h * D, D);
      const T* v = row + (nh + nkv) * D;
      for (int64_t i = 0; i < nkv * D; ++i) vd[i] = KV(f32(v[i]));
    }
  });
}

// `message` is one literal, as every other check's in the kernels. This was their one message
// formatted from parts (c10::str), and the test that reaches it died of SIGSEGV under
// torch 2.11+cu130 on a lent GPU host, where the literal checks before it raised.
void check_rows(const at::Tensor& t, int64_t width, const char* message) {
  TORCH_CHECK(t.dim() == 2 && t.is_contiguous() && t.size(1) == width, message);
}

}  // namespace

// x [T, H] fp32 or bf16, updated in place by `residual` [T, H] (empty: none); w [H].
at::Tensor add_rms_norm(at::Tensor x, const at::Tensor& residual, const at::Tensor& w, double eps) {
  const int64_t H = w.numel();
  check_rows(x, H, "x must be a contiguous [T, H] matrix");
  const bool add = residual.numel() > 0;
  if (add) check_rows(residual, H, "residual must be a contiguous [T, H] matrix");
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == x.scalar_type() &&
                  (!add || residual.scalar_type() == x.scalar_type()),
              "x, residual and w must share a dtype");
  auto y = at::empty_like(x);
  const int64_t rows = x.size(0);
  if (x.scalar_type() == at::kBFloat16) {
    using T = at::BFloat16;
    add_rms_norm_rows<T>(x.data_ptr<T>(), add ? residual.data_ptr<T>() : nullptr, w.data_ptr<T>(),
                         y.data_ptr<T>(), rows, H, float(eps));
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "x must be fp32 or bf16");
    add_rms_norm_rows<float>(x.data_ptr<float>(), add ? residual.data_ptr<float>() : nullptr,
                             w.data_ptr<float>(), y.data_ptr<float>(), rows, H, float(eps));
  }
  return y;
}

at::Tensor qk_norm(const at::Tensor& qkv, const at::Tensor& q_w, const at::Tensor& k_w, int64_t heads,
                   int64_t kv_heads, double eps) {
  const int64_t D = q_w.numel(), T = qkv.size(0);
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (heads + 2 * kv_heads) * D && k_w.numel() == D,
              "qkv must be [T, (heads + 2 kv_heads) D], the norms [D]");
  const at::Tensor none = at::empty({0}, qkv.options());
  // one row of add_rms_norm a head
  const at::Tensor q = qkv.narrow(1, 0, heads * D).contiguous().view({T * heads, D});
  const at::Tensor k = qkv.narrow(1, heads * D, kv_heads * D).contiguous().view({T * kv_heads, D});
  return at::cat({add_rms_norm(q, none, q_w, eps).view({T, heads * D}),
                  add_rms_norm(k, none, k_w, eps).view({T, kv_heads * D}),
                  qkv.narrow(1, (heads + kv_heads) * D, kv_heads * D)},
                 1);
}

// qkv [T, (nh + 2 nkv) D] -> q [T, nh, D] after RoPE; K (after RoPE) and V go to the pools
// [slots, nkv, D] at `slots` [T]. cos, sin [T, D] in qkv's dtype.
at::Tensor rope_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                      at::Tensor k_pool, at::Tensor v_pool, const at::Tensor& slots,
                      int64_t nh, int64_t nkv) {
  const int64_t D = cos.size(1), rows = qkv.size(0);
  check_rows(qkv, (nh + 2 * nkv) * D,
             "qkv must be a contiguous [T, (heads + 2 kv_heads) head_dim] matrix");
  check_rows(cos, D, "cos must be a contiguous [T, D] matrix");
  check_rows(sin, D, "sin must be a contiguous [T, D] matrix");
  TORCH_CHECK(D % 2 == 0 && cos.size(0) == rows && sin.size(0) == rows, "cos/sin per row");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() && k_pool.dim() == 3 &&
                  k_pool.size(1) == nkv && k_pool.size(2) == D && v_pool.sizes() == k_pool.sizes(),
              "pools must be contiguous [slots, kv_heads, head_dim]");
  TORCH_CHECK(slots.is_contiguous() && slots.scalar_type() == at::kLong && slots.numel() == rows,
              "one int64 slot per row");
  const auto dtype = qkv.scalar_type();
  TORCH_CHECK(cos.scalar_type() == dtype && sin.scalar_type() == dtype, "qkv, cos and sin must share a dtype");
  check_kv_dtypes(dtype, k_pool, v_pool);
  const int64_t* s = slots.data_ptr<int64_t>();
  const int64_t capacity = k_pool.size(0);
  for (int64_t r = 0; r < rows; ++r) TORCH_CHECK(0 <= s[r] && s[r] < capacity, "slot out of the pool");
  auto q = at::empty({rows, nh, D}, qkv.options());
  with_kv_dtypes(dtype, k_pool.scalar_type(), [&](auto q_type, auto kv_type) {
    using T = decltype(q_type);
    using KV = decltype(kv_type);
    rope_store_rows<T, KV>(qkv.data_ptr<T>(), cos.data_ptr<T>(), sin.data_ptr<T>(),
                           k_pool.data_ptr<KV>(), v_pool.data_ptr<KV>(), s, q.data_ptr<T>(), rows,
                           nh, nkv, D);
  });
  return q;
}

namespace {

// exp(x) for x <= 0 with exp_poly.h's constants, in plain float operations in a fixed
// order (no FMA contraction here), which GCC vectorises: the same bits at any vector width,
// on either ISA. n rounds to nearest by the 1.5 * 2^23 trick; 2^n is built in the
// exponent field.
inline float exp_nonpositive(float x) {
  using namespace exp_poly;
  x = x < MIN_X ? MIN_X : x;
  const float n = (x * LOG2E + 12582912.f) - 12582912.f;
  float r = x - n * LN2_HI;
  r = r - n * LN2_LO;
  float p = C[0];
  for (int i = 1; i <= DEGREE; ++i) p = p * r + C[i];
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return p * two_n;
}

// silu(g) = g / (1 + exp(-g)), from exp of -|g| only: g >= 0 takes g / (1 + e),
// g < 0 takes g e / (1 + e) (e = exp(g) there, so nothing overflows)
inline float silu(float g) {
  const float e = exp_nonpositive(g < 0.f ? g : -g);
  const float num = g < 0.f ? g * e : g;
  return num / (1.f + e);
}

void silu_mul_bf16(const uint16_t* g, const uint16_t* u, uint16_t* o, int64_t n) {
  for (int64_t i = 0; i < n; ++i) o[i] = to_bf16(from_bf16(to_bf16(silu(from_bf16(g[i])))) * from_bf16(u[i]));
}

void silu_mul_f32(const float* g, const float* u, float* o, int64_t n) {
  for (int64_t i = 0; i < n; ++i) o[i] = silu(g[i]) * u[i];
}

template <typename T, typename F>
void silu_mul_rows(const T* gu, T* out, int64_t rows, int64_t I, F&& row_fn) {
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) row_fn(gu + r * 2 * I, gu + r * 2 * I + I, out + r * I, I);
  });
}

}  // namespace

// gate_up [T, 2I] -> silu(gate) * up [T, I], rounded where torch's silu and mul round
// (silu's output to T, then the product); exp is our own polynomial (above), not torch's
// Sleef, so a bf16 result can be one unit off torch's. At one row this was ~13 us of
// torch ops a layer (the 1.5B: ~0.4 ms a step); rows are split over threads only between
// rows (batch invariance).
at::Tensor silu_mul(const at::Tensor& gate_up_any) {
  TORCH_CHECK(gate_up_any.dim() >= 1 && gate_up_any.size(-1) % 2 == 0, "gate_up must be [..., 2I]");
  const at::Tensor gate_up = gate_up_any.reshape({-1, gate_up_any.size(-1)}).contiguous();
  const int64_t rows = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out_shape = gate_up_any.sizes().vec();
  out_shape.back() = I;
  auto out = at::empty(out_shape, gate_up.options());
  if (gate_up.scalar_type() == at::kBFloat16) {
    const auto* gu = reinterpret_cast<const uint16_t*>(gate_up.data_ptr<at::BFloat16>());
    silu_mul_rows(gu, reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), rows, I, silu_mul_bf16);
  } else {
    TORCH_CHECK(gate_up.scalar_type() == at::kFloat, "gate_up must be fp32 or bf16");
    silu_mul_rows(gate_up.data_ptr<float>(), out.data_ptr<float>(), rows, I, silu_mul_f32);
  }
  return out;
}
