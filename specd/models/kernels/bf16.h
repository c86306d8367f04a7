// bf16 <-> fp32 in registers, shared by the int8/int4 matmul, the dense matmul and paged
// attention.
// fp32 -> bf16 rounds to nearest even, as torch's .to(bfloat16) does for finite values:
// add 0x7FFF plus the lowest kept bit, then keep the high 16 bits.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
inline __m256i bf16_from_floats16(__m512 v) {
  __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16));
}
inline __m512 floats_from_bf16_16(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

inline __m128i bf16_from_floats8(__m256 v) {
  __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  bits = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  // 8 x int32 (< 2^16) -> 8 x uint16: packus works per 128-bit lane, so keep qwords 0 and 2
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0x08));
}
inline __m256 floats_from_bf16_8(__m128i h) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// 8 16-bit values at p widened to fp32, exactly: bf16 (its bits the top half of the
// fp32's) or fp16 (F16C); shared by paged attention's 16-bit caches and the dense matmul's
// 16-bit weights
inline __m256 load8_bf16(const void* p) {
  return floats_from_bf16_8(_mm_loadu_si128(static_cast<const __m128i*>(p)));
}
inline __m256 load8_half(const void* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(static_cast<const __m128i*>(p)));
}

// one value, by its bits, with the same rounding as the vectors above: plain integer
// operations, so that a scalar loop of them vectorises
inline float from_bf16(uint16_t h) {
  const uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline uint16_t to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return uint16_t((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}
