// fp32 linear for decode and verification rows, batch-invariant:
//     y[r][n] = sum_k x[r][k] w[n][k]
// summed for each (r, n) in one fixed order whatever the number of rows: lane l of one
// ymm takes k = l, l + 8, l + 16, ... by FMA (a row's last K % 8 inputs padded with
// zeros, which add nothing), then hsum8's fixed tree. Register blocks of up to RB rows x
// CB columns share each vector they load, and threads split columns only, so a row's
// result never depends on the other rows: decode of one token and verification of k + 1
// round identically. The weights are read once a call (each block of CB columns stays in
// cache while every row block passes over it). Both builds run these AVX2 instructions
// and round alike.
//
// w is fp32, or bf16 or fp16 as a 16-bit checkpoint stores it: each weight is widened to
// fp32 in a register, exactly, so a 16-bit matrix gives the bits its fp32 copy would from
// half the bytes.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "bf16.h"
#include "reduce.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

constexpr int RB = 4;  // rows per register block
constexpr int CB = 3;  // columns per register block: RB x CB accumulators, CB weights, 1 row

// 8 consecutive weights as fp32: as stored, or widened (bf16.h)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) { return load8_bf16(p); }
inline __m256 load8(const at::Half* p) { return load8_half(p); }

// the first `n` (< 8) values, the rest zeros
template <typename T>
inline __m256 load_first(const T* p, int64_t n) {
  T tail[8] = {};
  std::memcpy(tail, p, n * sizeof(T));
  return load8(tail);
}

template <int R, int C, typename W>
void block(const float* x, int64_t ldx, const W* w, int64_t K, float* y, int64_t ldy) {
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  const int64_t body = K & ~int64_t(7);
  for (int64_t k = 0; k < body; k += 8) {
    __m256 wv[C];
    for (int c = 0; c < C; ++c) wv[c] = load8(w + c * K + k);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * ldx + k);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  if (body < K) {
    __m256 wv[C];
    for (int c = 0; c < C; ++c) wv[c] = load_first(w + c * K + body, K - body);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = load_first(x + r * ldx + body, K - body);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[r * ldy + c] = hsum8(acc[r][c]);
}

template <int C, typename W>
void rows_block(int64_t rows, const float* x, int64_t ldx, const W* w, int64_t K, float* y,
                int64_t ldy) {
  switch (rows) {
    case 1: return block<1, C>(x, ldx, w, K, y, ldy);
    case 2: return block<2, C>(x, ldx, w, K, y, ldy);
    case 3: return block<3, C>(x, ldx, w, K, y, ldy);
    default: return block<RB, C>(x, ldx, w, K, y, ldy);
  }
}

template <typename W>
void linear(const float* xp, const W* wp, float* yp, int64_t M, int64_t K, int64_t N) {
  const int64_t blocks = (N + CB - 1) / CB;
  // a thread's share: at least ~64 KiB of weights, so small matrices stay on one thread
  const int64_t grain =
      std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(1, CB * K * int64_t(sizeof(W))));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n = b * CB, cols = std::min<int64_t>(CB, N - n);
      for (int64_t r = 0; r < M; r += RB) {
        const int64_t rows = std::min<int64_t>(RB, M - r);
        const float* xr = xp + r * K;
        const W* wn = wp + n * K;
        float* yr = yp + r * N + n;
        if (cols == 3) rows_block<3>(rows, xr, K, wn, K, yr, N);
        else if (cols == 2) rows_block<2>(rows, xr, K, wn, K, yr, N);
        else rows_block<1>(rows, xr, K, wn, K, yr, N);
      }
    }
  });
}

}  // namespace

at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "dense_linear: x [M, K] and w [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "dense_linear: fp32 activations only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "dense_linear: contiguous x and w");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  switch (w.scalar_type()) {
    case at::kFloat: linear(xp, w.data_ptr<float>(), yp, M, K, N); break;
    case at::kBFloat16: linear(xp, w.data_ptr<at::BFloat16>(), yp, M, K, N); break;
    case at::kHalf: linear(xp, w.data_ptr<at::Half>(), yp, M, K, N); break;
    default: TORCH_CHECK(false, "dense_linear: weights in fp32, bf16 or fp16");
  }
  return y;
}
