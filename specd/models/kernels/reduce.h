// Horizontal reductions of one ymm, shared by the int8/int4 matmul (the activations'
// amax) and paged attention (a row's max score).
#pragma once

#include <immintrin.h>

// the largest of 8 floats (max is exact: the order of the comparisons changes nothing)
inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
