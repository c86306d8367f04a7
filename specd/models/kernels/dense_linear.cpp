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

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "reduce.h"

#include <algorithm>
#include <cstdint>

namespace {

constexpr int RB = 4;  // rows per register block
constexpr int CB = 3;  // columns per register block: RB x CB accumulators, CB weights, 1 row

// the mask of the first `n` (< 8) lanes
inline __m256i first_lanes(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

template <int R, int C>
void block(const float* x, int64_t ldx, const float* w, int64_t K, float* y, int64_t ldy) {
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  const int64_t body = K & ~int64_t(7);
  for (int64_t k = 0; k < body; k += 8) {
    __m256 wv[C];
    for (int c = 0; c < C; ++c) wv[c] = _mm256_loadu_ps(w + c * K + k);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * ldx + k);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  if (body < K) {
    const __m256i mask = first_lanes(K - body);
    __m256 wv[C];
    for (int c = 0; c < C; ++c) wv[c] = _mm256_maskload_ps(w + c * K + body, mask);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_maskload_ps(x + r * ldx + body, mask);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[r * ldy + c] = hsum8(acc[r][c]);
}

template <int C>
void rows_block(int64_t rows, const float* x, int64_t ldx, const float* w, int64_t K, float* y,
                int64_t ldy) {
  switch (rows) {
    case 1: return block<1, C>(x, ldx, w, K, y, ldy);
    case 2: return block<2, C>(x, ldx, w, K, y, ldy);
    case 3: return block<3, C>(x, ldx, w, K, y, ldy);
    default: return block<RB, C>(x, ldx, w, K, y, ldy);
  }
}

}  // namespace

at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "dense_linear: x [M, K] and w [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat,
              "dense_linear: fp32 only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "dense_linear: contiguous x and w");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t blocks = (N + CB - 1) / CB;
  // a thread's share: at least ~64 KiB of weights, so small matrices stay on one thread
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 14) / std::max<int64_t>(1, CB * K));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n = b * CB, cols = std::min<int64_t>(CB, N - n);
      for (int64_t r = 0; r < M; r += RB) {
        const int64_t rows = std::min<int64_t>(RB, M - r);
        const float* xr = xp + r * K;
        const float* wn = wp + n * K;
        float* yr = yp + r * N + n;
        if (cols == 3) rows_block<3>(rows, xr, K, wn, K, yr, N);
        else if (cols == 2) rows_block<2>(rows, xr, K, wn, K, yr, N);
        else rows_block<1>(rows, xr, K, wn, K, yr, N);
      }
    }
  });
  return y;
}
