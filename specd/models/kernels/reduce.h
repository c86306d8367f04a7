// Horizontal reductions of one ymm, shared by the int8/int4 matmul (the activations'
// amax) and paged attention (a row's max score, its sums).
#pragma once

#include <immintrin.h>

// the largest of 8 floats (max is exact: the order of the comparisons changes nothing)
inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// the sum of 8 floats in a fixed tree: lanes 4 apart, then 2, then 1 (the order paged
// attention's sums are defined in, on either ISA)
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
