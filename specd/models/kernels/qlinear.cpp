// Group-quantised linear for decode and verification on x86 CPUs: AVX512-VNNI, or AVX2
// (with FMA and F16C) where the CPU has no AVX512 (the build picks by its -m flags).
//
// Weights (N output rows, K inputs, groups of G = 32 along K):
//     w[n][k] = d[n][g] * q[n][k] - m[n][g],   g = k / 32,  q unsigned (4 or 8 bits)
//     w[n][k] = d[n][h] * (q[n][k] - 32),       h = k / 16,  q unsigned 6 bits (Q6_K's form)
// 4 and 6 bits take the two-level scales of Q4_K and Q6_K: per super-block of 8 groups
// (256 along K) an fp16 D (and for 4 bits M) per column, and integers below it: 4 bits
// 6-bit s and t per group, d = D s, m = M t; 6 bits an int8 per half-group, d = D sc
// (exact in fp32: 11 bits of mantissa times at most 8).
// Activations, quantised here per row and per block b along K, as llama.cpp's Q8_K
// activations: for 4 and 6 bits up to 8 groups (256 along K, a weight super-block; the
// last of a row may be shorter), for 8 bits one group:
//     x[r][k] ~= sx[r][b] * xq[r][k],          xq in [-127, 127]
// The dot of a group is exact in int32 (vpdpbusd: u8 weight x s8 activation; on AVX2
// vpmaddubsw on 4-bit halves, see below). 8 bits add a group's float terms at once:
//     y[r][n] = sum_g  d[n][g] * sx[r][g] * dot(q[n][g], xq[r][g]) - m[n][g] * sx[r][g] * sum(xq[r][g])
// 4 and 6 bits sum a super-block's terms in integers first, the integer scales inside
// (4 bits d = D s, m = M t; 6 bits d = D sc, per half-group h, the offset -32 in the
// integers too), and take one float step per super-block:
//     y[r][n] = sum_b  sx[r][b] * (D[n][b] * sum_g s[n][g] dot_g - M[n][b] * sum_g t[n][g] sum_g(xq))
//     y[r][n] = sum_b  sx[r][b] * D[n][b] * sum_h sc[n][h] (dot_h - 32 sum_h(xq))      (6 bits)
// which at 7 rows, where the kernel is bound by compute, takes 17% off a call on AVX2 and
// ~10% on AVX512 (docs/benchmarks-log.md sections 47, 48). Either way the float terms are
// added in a fixed order for each (r, n) with the same instructions whatever the number
// of rows, and threads split columns only: a row's result never depends on the other rows
// (decode of 1 token and verification of k+1 round identically: batch invariance).
//
// Layout (see specd/models/qlinear.py::pack): columns in tiles of 16, and each tile one
// sequential stream. 8 bits: per (tile, group) one record: the codes, then 16 fp16
// scales, then 16 fp16 mins. 4 and 6 bits: per (tile, super-block) a 320-byte header (16
// fp16 D, 16 fp16 M (zero for 6 bits), then 4 bits' s and t as uint8 [8 groups][16
// columns] each, or 6 bits' int8 [16 half-groups][16 columns]), then the codes of its
// groups (the last super-block of a row may hold fewer than 8). Codes: 8 vectors of 64
// bytes, vector j holding k = 4j..4j+3
// for the 16 columns (byte c*4+i = q[c][4j+i]), which is the operand order of vpdpbusd;
// 4-bit codes pack vectors 2s and 2s+1 into one: low nibbles are k = 8s..8s+3, high
// nibbles k = 8s+4..8s+7. 6-bit codes are the 4-bit layout of their low nibbles, then two
// vectors of their top two bits: vector j's at bits 2(j%4), 2(j%4)+1 of vector j/4.
// Each tile is unpacked once and used for every row.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "bf16.h"
#include "reduce.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <utility>

#include <cpuid.h>
#include <csetjmp>
#include <csignal>
#include <sys/syscall.h>
#include <unistd.h>

namespace {

constexpr int G = 32;       // group size along K
constexpr int NT = 16;      // columns per tile: one zmm of fp32
constexpr int RMAX = 8;     // rows per register block
// How far ahead a tile's stream is fetched, into L2 (for_each_group): 24 groups (4 and 6
// bits: 6-9 KiB), 12 records (8 bits: 6.8 KiB)
constexpr int PREFETCH = 24;
constexpr int PREFETCH_RECORDS = 12;
constexpr int SB = 8;       // 4 and 6 bits: groups per super-block
constexpr int64_t HEADER = 64 + 2 * SB * NT;  // 4 and 6 bits: a super-block's scales and mins

// Activations are quantised per row and per block: a group (32 along K), or for 4 and 6
// bits up to 8 groups (256 along K, the weights' super-block; the last block of a
// row may be shorter), as llama.cpp's Q8_K (`act_groups`): one scale amax / 127 for the
// block, codes round(v * 127 / amax) (nearest even). Each
// 32-block gets its codes, the block's scale, scale * sum(codes) and the sums of its two
// 16-blocks. Both builds do it in vectors (AVX512 two, AVX2 four) with the same float
// operations per value (one product and one rounding to nearest even), so the same codes
// and scales; decode calls it on the model thread alone, once per matrix, while the other
// threads wait.
#if defined(__AVX512F__)
inline float block_amax(const float* v) {
  return _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(v)),
                                            _mm512_abs_ps(_mm512_loadu_ps(v + 16))));
}
inline void quantize_block(const float* v, float amax, int8_t* q, int& low, int& high) {
  const __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16);
  const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv));  // MXCSR: nearest even
  const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(qb));
  low = _mm512_reduce_add_epi32(qa);
  high = _mm512_reduce_add_epi32(qb);
}
#else  // AVX2
inline int hsum8(__m256i v) {
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  t = _mm_add_epi32(t, _mm_unpackhi_epi64(t, t));
  return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 1)));
}

inline float block_amax(const float* v) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 m = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(v + 8 * i)));
  return hmax8(m);
}

// as the AVX512 version, in four vectors
inline void quantize_block(const float* v, float amax, int8_t* q, int& low, int& high) {
  const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  __m256i c[4];
  for (int i = 0; i < 4; ++i)  // MXCSR: nearest even
    c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 8 * i), inv));
  // packs work per 128-bit lane: the dwords come out as c0 lo, c1 lo, c2 lo, c3 lo, c0 hi, ...
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  low = hsum8(_mm256_add_epi32(c[0], c[1]));
  high = hsum8(_mm256_add_epi32(c[2], c[3]));
}
#endif

// The sums of a 32-block's two 16-blocks of codes (each at most 16 * 127 in magnitude, 6
// bits' offsets) as the kernels take them: AVX512 and AMX as two int32, AVX2 as one int32
// holding both as int16, the pair vpmaddwd multiplies in the super-block's terms
#if defined(__AVX512VNNI__)
constexpr int64_t HALF_WORDS = 2;
inline void store_halves(int32_t* h, int low, int high) {
  h[0] = low;
  h[1] = high;
}
#else
constexpr int64_t HALF_WORDS = 1;
inline void store_halves(int32_t* h, int low, int high) {
  h[0] = int32_t(uint32_t(uint16_t(low)) | (uint32_t(uint16_t(high)) << 16));
}
#endif

// int32 words that hold a row's group sums two by two (4 bits: (sum_2i, sum_2i+1) as int16,
// the pair vpmaddwd or vpdpwssd multiplies by the mins' integers; each sum at most 32 * 127)
inline int64_t pairs_of(int64_t KG) { return (KG + 1) / 2; }

// Per row and 32-block: its block's scale (a block being `per_block` groups: 1 or SB),
// the codes and scale * sum(codes); with `halves`, the sums of the codes of each 16-block
// as well (store_halves), with `group_sums` those of the 32-block (pairs_of).
void quantize_rows(const at::Tensor& x, int64_t per_block, int8_t* xq, float* sx, float* c,
                   int32_t* halves, int16_t* group_sums) {
  const int64_t M = x.size(0), K = x.size(1), KG = K / G;
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const auto* xf = bf16 ? nullptr : x.data_ptr<float>();
  const auto* xb = bf16 ? reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()) : nullptr;
  // rows are independent: splitting them over threads changes no result
  at::parallel_for(0, M, 1, [&](int64_t r0, int64_t r1) {
    alignas(64) float v[SB * G];
    for (int64_t r = r0; r < r1; ++r) {
      if (group_sums && KG % 2) group_sums[r * pairs_of(KG) * 2 + KG] = 0;  // no group: sum 0
      for (int64_t g0 = 0; g0 < KG; g0 += per_block) {
        const int64_t groups = std::min<int64_t>(per_block, KG - g0);
        if (bf16) {  // bf16 -> fp32 is exact: the bits shifted up
          for (int64_t i = 0; i < groups * G; ++i) {
            const uint32_t bits = uint32_t(xb[r * K + g0 * G + i]) << 16;
            std::memcpy(&v[i], &bits, 4);
          }
        }
        const float* block = bf16 ? v : xf + r * K + g0 * G;
        float amax = 0.f;  // max is exact: the order of the comparisons changes nothing
        for (int64_t j = 0; j < groups; ++j) amax = std::max(amax, block_amax(block + j * G));
        const float s = amax / 127.f;
        for (int64_t j = 0; j < groups; ++j) {
          const int64_t g = g0 + j;
          int low, high;
          quantize_block(block + j * G, amax, xq + r * K + g * G, low, high);
          sx[r * KG + g] = s;
          c[r * KG + g] = s * float(low + high);
          if (halves) store_halves(halves + (r * KG + g) * HALF_WORDS, low, high);
          if (group_sums) group_sums[r * pairs_of(KG) * 2 + g] = int16_t(low + high);
        }
      }
    }
  });
}

template <int BITS>
constexpr int64_t code_bytes() { return G * NT * BITS / 8; }
template <int BITS>
constexpr int64_t record_bytes() { return code_bytes<BITS>() + 4 * NT; }  // + fp16 scales, mins
// 4 and 6 bits: bytes ahead in a tile's stream to prefetch
template <int BITS>
constexpr int64_t ahead() { return PREFETCH * code_bytes<BITS>() + HEADER; }

// 4 and 6 bits: the bytes of one tile's stream, for KG groups
int64_t tile_bytes(int64_t KG, int64_t bits) { return (KG + SB - 1) / SB * HEADER + KG * G * NT * bits / 8; }

// A tile's stream is fetched ahead as it is walked (the weights are read once per forward;
// past the end of a tile into the next one, which is the next in memory). The fetches go
// to L2 (T1), far ahead: one group of one row takes ~20 cycles, so 6 groups ahead into L1
// (as before) asked for each line ~40 ns before its use, under the memory's latency, and
// the L1's few miss buffers held the stream back; then every row beyond the first added
// its compute to the time of a call instead of running under the stream. Paired forwards
// of the 1.5B on a Zen 4 (docs/benchmarks-log.md section 51): 3 rows 0.80-0.98x the time, 7 rows
// 0.83-0.93x; 1 row 0.89x while memory was slow, 1.05x while it was fast; the 0.5B
// drafter 0.73-0.91x.

// 4 and 6 bits: the fetch for group j of the super-block whose header is at p (the
// header's lines too, with its first group)
template <int BITS>
inline void prefetch_group(const uint8_t* p, int64_t j) {
  constexpr int64_t cb = code_bytes<BITS>();
  const uint8_t* wg = p + HEADER + cb * j;
  for (const uint8_t* line = j ? wg : p; line < wg + cb; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(line + ahead<BITS>()), _MM_HINT_T1);
}

// 4 and 6 bits: calls fn(p, groups, g0) for each super-block of a tile's stream: p at its
// header, its `groups` groups (8, or fewer in a row's last) from group g0
template <int BITS, typename Fn>
inline void for_each_super_block(const uint8_t* wt, int64_t KG, Fn&& fn) {
  const uint8_t* p = wt;
  for (int64_t g0 = 0; g0 < KG; g0 += SB) {
    const int64_t groups = std::min<int64_t>(SB, KG - g0);
    fn(p, groups, g0);
    p += HEADER + code_bytes<BITS>() * groups;
  }
}

// Walks a tile's stream group by group, fetching ahead, and calls fn(codes, head, j, g)
// for group g: 8 bits with its record's fp16 scales and mins, 4 and 6 bits with its
// super-block's header, j being its place there.
template <int BITS, typename Fn>
inline void for_each_group(const uint8_t* wt, int64_t KG, Fn&& fn) {
  if constexpr (BITS == 8) {
    constexpr int64_t rec = record_bytes<BITS>();
    for (int64_t g = 0; g < KG; ++g) {
      const uint8_t* wg = wt + g * rec;
      for (int64_t line = 0; line < rec; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(wg + PREFETCH_RECORDS * rec + line), _MM_HINT_T1);
      fn(wg, wg + code_bytes<BITS>(), 0, g);
    }
  } else {
    for_each_super_block<BITS>(wt, KG, [&](const uint8_t* p, int64_t groups, int64_t g0) {
      for (int64_t j = 0; j < groups; ++j) {
        prefetch_group<BITS>(p, j);
        fn(p + HEADER + code_bytes<BITS>() * j, p, j, g0 + j);
      }
    });
  }
}

#if defined(__AVX512VNNI__)

inline void store_row(__m512 v, void* out, bool bf16_out, int64_t offset) {
  if (!bf16_out) {
    _mm512_storeu_ps(static_cast<float*>(out) + offset, v);
    return;
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + offset),
                      bf16_from_floats16(v));
}

// acc += dot4(u8 w, s8 x) per 32-bit lane with the same 4 activation bytes *x in every
// lane, broadcast by the instruction's memory operand ({1to16}): one fused uop where
// _mm512_set1_epi32 + _mm512_dpbusd_epi32 compile to two. The integer sums are exact.
inline __m512i dpbusd_broadcast(__m512i acc, __m512i w, const int32_t* x) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*x));
  return acc;
}

// A group's 8 code vectors as bytes, each the codes of k = 4j..4j+3 for the 16 columns
// (layout: top of this file): the operand order of vpdpbusd, and of an AMX B tile's rows.
template <int BITS>
inline void unpack_group(const uint8_t* wg, __m512i* w) {
  if constexpr (BITS == 8) {
    for (int j = 0; j < 8; ++j) w[j] = _mm512_loadu_si512(wg + 64 * j);
    return;
  }
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int s = 0; s < 4; ++s) {
    const __m512i v = _mm512_loadu_si512(wg + 64 * s);
    w[2 * s] = _mm512_and_si512(v, low4);
    w[2 * s + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
  }
  if constexpr (BITS == 6) {  // q = low nibble | top two bits << 4
    const __m512i top = _mm512_set1_epi8(0x30);
    for (int t = 0; t < 2; ++t) {
      const __m512i v = _mm512_loadu_si512(wg + 256 + 64 * t);
      w[4 * t] = _mm512_or_si512(w[4 * t], _mm512_and_si512(_mm512_slli_epi16(v, 4), top));
      w[4 * t + 1] = _mm512_or_si512(w[4 * t + 1], _mm512_and_si512(_mm512_slli_epi16(v, 2), top));
      w[4 * t + 2] = _mm512_or_si512(w[4 * t + 2], _mm512_and_si512(v, top));
      w[4 * t + 3] = _mm512_or_si512(w[4 * t + 3], _mm512_and_si512(_mm512_srli_epi16(v, 2), top));
    }
  }
}

// 8 bits: a group's fp16 scales dg and mins mg for the tile's 16 columns, from its record
inline void group_scales(const uint8_t* head, __m512& dg, __m512& mg) {
  const auto* dm = reinterpret_cast<const __m256i*>(head);
  dg = _mm512_cvtph_ps(_mm256_loadu_si256(dm));
  mg = _mm512_cvtph_ps(_mm256_loadu_si256(dm + 1));
}

// 8 bits: the float terms of one group for one row, acc + dg sx dot - mg c. The vector and
// the AMX path both end in this, so they round alike.
inline __m512 add_group(__m512 acc, __m512i dot, __m512 dg, __m512 mg, float sx, float c) {
  const __m512 scale = _mm512_mul_ps(dg, _mm512_set1_ps(sx));
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc);
  return _mm512_fnmadd_ps(mg, _mm512_set1_ps(c), acc);
}

// 8 bits: one group (32 along K) of a tile's 16 columns into acc[r] for every row: its
// codes at `wg`, its scales dg and mins mg
template <int R>
inline void group_rows8(__m512* acc, const uint8_t* wg, __m512 dg, __m512 mg, int64_t g, int64_t KG,
                        const int8_t* xq, const float* sx, const float* c, int64_t K) {
  __m512i w[8];
  unpack_group<8>(wg, w);
  for (int r = 0; r < R; ++r) {
    // one chain per row (the rows give the parallelism); each step reads its 4
    // activation bytes as a broadcast operand of vpdpbusd itself
    const auto* xg = reinterpret_cast<const int32_t*>(xq + r * K + g * G);
    __m512i dot = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) dot = dpbusd_broadcast(dot, w[j], xg + j);
    acc[r] = add_group(acc[r], dot, dg, mg, sx[r * KG + g], c[r * KG + g]);
  }
}

// 4 and 6 bits: the integer scales of group j of a super-block (header `head`) for the
// tile's 16 columns, as int32: 4 bits s_j (sl), 6 bits the low and the high half-group's
// sc (sl, sh)
template <int BITS>
inline void int_scales(const uint8_t* head, int64_t j, __m512i& sl, __m512i& sh) {
  const auto bytes = [](const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); };
  if constexpr (BITS == 4) {
    sl = sh = _mm512_cvtepu8_epi32(bytes(head + 64 + NT * j));
  } else {
    sl = _mm512_cvtepi8_epi32(bytes(head + 64 + 2 * NT * j));
    sh = _mm512_cvtepi8_epi32(bytes(head + 64 + 2 * NT * j + NT));
  }
}

// A group's integer dots for one row under the weights' integer scales, added to the
// super-block's sum ai: 4 bits ai + s_j dot, 6 bits ai + sc_lo lo + sc_hi hi (each half's
// dot with its offset -32 sum(xq) in it). vpmulld is exact: a super-block's sum is at most
// 8 * 63 * 60960 < 2^25 (4 bits) and 16 * 128 * 16 * 32 * 127 < 2^28 (6 bits: |sc| <= 128,
// |q - 32| <= 32). The vector and the AMX path both take this on the same integers, so
// they give the same sums.
template <int BITS>
inline __m512i add_int_group(__m512i ai, __m512i lo, __m512i hi, __m512i sl, __m512i sh) {
  ai = _mm512_add_epi32(ai, _mm512_mullo_epi32(lo, sl));
  if constexpr (BITS == 6) ai = _mm512_add_epi32(ai, _mm512_mullo_epi32(hi, sh));
  return ai;
}

// 4 and 6 bits, at the end of a super-block of `groups` groups from g0 (header `head`):
// its float terms for every row, once, from the integer sums ai, which are cleared. With
// the block's activation scale sx and the activations' group sums two by two (int16
// pairs, pairs_of):
//     4 bits: acc += D sx ai - M sx sum_j t_j sum_j     (the second sum exact: vpdpwssd)
//     6 bits: acc += D sx ai                            (the offsets are in ai)
template <int R, int BITS>
inline void super_block_rows(__m512* acc, __m512i* ai, const uint8_t* head, int64_t groups,
                             int64_t g0, int64_t KG, const float* sx, const int32_t* group_sums) {
  const auto* dm = reinterpret_cast<const __m256i*>(head);
  const __m512 D = _mm512_cvtph_ps(_mm256_loadu_si256(dm));
  const __m512 M = _mm512_cvtph_ps(_mm256_loadu_si256(dm + 1));
  // 4 bits: per two groups the int16 pairs (t_2i, t_2i+1) of each column, the integers
  // past a short last super-block zero (the header's), as are the sums past a row's last
  // group (pairs_of)
  // (t_2i's 16 bytes, then t_2i+1's, widened to int16 and interleaved by one vpermw: this
  // runs per tile and super-block whatever the rows, so it is kept to two instructions)
  const int64_t units = BITS == 4 ? (groups + 1) / 2 : 0;
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                              23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  __m512i tm[SB / 2];
  for (int64_t i = 0; i < units; ++i) {
    const auto* t = reinterpret_cast<const __m256i*>(head + 64 + NT * (SB + 2 * i));
    tm[i] = _mm512_permutexvar_epi16(interleave, _mm512_cvtepu8_epi16(_mm256_loadu_si256(t)));
  }
#pragma GCC unroll 8  // each row its own register (tile_rows)
  for (int r = 0; r < R; ++r) {
    const __m512 s = _mm512_set1_ps(sx[r * KG + g0]);
    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ai[r]), _mm512_mul_ps(D, s), acc[r]);
    if constexpr (BITS == 4) {
      const int32_t* pr = group_sums + r * pairs_of(KG) + g0 / 2;
      __m512i mi = _mm512_setzero_si512();
      for (int64_t i = 0; i < units; ++i) mi = _mm512_dpwssd_epi32(mi, tm[i], _mm512_set1_epi32(pr[i]));
      acc[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mi), _mm512_mul_ps(M, s), acc[r]);
    }
    ai[r] = _mm512_setzero_si512();
  }
}

// 4 and 6 bits: one group of a tile's 16 columns into the integer sums ai[r] for every row
template <int R, int BITS>
inline void group_rows_int(__m512i* ai, const uint8_t* wg, const uint8_t* head, int64_t j, int64_t g,
                           int64_t KG, const int8_t* xq, const int32_t* halves, int64_t K) {
  __m512i w[8], sl, sh;
  unpack_group<BITS>(wg, w);
  int_scales<BITS>(head, j, sl, sh);
#pragma GCC unroll 8  // each row its own register (tile_rows)
  for (int r = 0; r < R; ++r) {
    const auto* xg = reinterpret_cast<const int32_t*>(xq + r * K + g * G);
    if constexpr (BITS == 6) {  // vectors 0-3 are the low half-group, 4-7 the high
      const int32_t* hs = halves + r * 2 * KG + 2 * g;
      __m512i lo = _mm512_set1_epi32(-32 * hs[0]), hi = _mm512_set1_epi32(-32 * hs[1]);
      for (int i = 0; i < 4; ++i) lo = dpbusd_broadcast(lo, w[i], xg + i);
      for (int i = 4; i < 8; ++i) hi = dpbusd_broadcast(hi, w[i], xg + i);
      ai[r] = add_int_group<6>(ai[r], lo, hi, sl, sh);
    } else {
      __m512i dot = _mm512_setzero_si512();
      for (int i = 0; i < 8; ++i) dot = dpbusd_broadcast(dot, w[i], xg + i);
      ai[r] = add_int_group<4>(ai[r], dot, dot, sl, sh);
    }
  }
}

template <int R, int BITS>
void tile_rows(const uint8_t* wt, int64_t KG,
               const int8_t* xq, const float* sx, const float* c, const int32_t* halves,
               const int32_t* group_sums, int64_t K, const float* bias, void* out, bool bf16_out,
               int64_t ldo, int64_t n0) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  if constexpr (BITS == 8) {
    for_each_group<8>(wt, KG, [&](const uint8_t* wg, const uint8_t* head, int64_t, int64_t g) {
      __m512 dg, mg;
      group_scales(head, dg, mg);
      group_rows8<R>(acc, wg, dg, mg, g, KG, xq, sx, c, K);
    });
  } else {
    // A super-block's integer sums ai are declared within it, and the row loops that
    // touch them are unrolled, so that they stay in registers: held across for_each_group's
    // per-group callback, or indexed by a rolled row, they went to the stack, a load and a
    // store of each row's sum every group. Paired 1.5B forwards (docs/benchmarks-log.md section
    // 52): 4 rows ~0.94-0.96x the time, 7 rows ~0.95x, 16 rows ~0.94x; 1 row the same.
    for_each_super_block<BITS>(wt, KG, [&](const uint8_t* p, int64_t groups, int64_t g0) {
      __m512i ai[R];
      for (int r = 0; r < R; ++r) ai[r] = _mm512_setzero_si512();
      for (int64_t j = 0; j < groups; ++j) {
        prefetch_group<BITS>(p, j);
        group_rows_int<R, BITS>(ai, p + HEADER + code_bytes<BITS>() * j, p, j, g0 + j, KG, xq, halves, K);
      }
      super_block_rows<R, BITS>(acc, ai, p, groups, g0, KG, sx, group_sums);
    });
  }
  const __m512 b = bias ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) store_row(_mm512_add_ps(acc[r], b), out, bf16_out, r * ldo + n0);
}

// AMX (Sapphire Rapids and later, where the OS grants the tile state): the integer dot of
// a group for every row at once, C[r][n] = sum_k xq[r][k] * q[n][k] (TDPBSUD: s8 rows of
// A, u8 columns of B), exact in int32 as vpdpbusd's, so the same integers as the path
// above; what follows is the same instructions in the same order (`add_group` for 8 bits,
// `add_int_group` and `super_block_rows` for 4 and 6), so the results are the same bits
// whichever path ran. B is the
// group's codes in vpdpbusd's operand order, which is AMX's too (a row of B holds k =
// 4j..4j+3 for the 16 columns): 8 bits load it from the stream as it is, 4 and 6 bits
// from the unpacked vectors. One tile operation replaces R * 8 vpdpbusd: what verification
// rows spend beyond a decode row's (docs/benchmarks-log.md section 36).
#define SPECD_AMX __attribute__((target("amx-tile,amx-int8")))

constexpr int AMX_ROWS = 16;  // rows of an A tile

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// A tiles hold `rows` activation rows of `kbytes` (32 a group, 16 a 6-bit half-group), B
// tiles kbytes / 4 rows of 64, C tiles `rows` of 16 int32. Tiles 0-2 are A, B, C of even
// groups and 3-5 of odd ones (4 and 8 bits); 6 bits use 0-5 for one group's two halves.
SPECD_AMX inline void configure_tiles(int rows, int kbytes) {
  TileConfig cfg;
  for (int t = 0; t < 6; ++t) {
    const int role = t % 3;  // A, B, C
    cfg.rows[t] = role == 1 ? kbytes / 4 : rows;
    cfg.colsb[t] = role == 0 ? kbytes : 64;
  }
  _tile_loadconfig(&cfg);
}

// One item's integer dots into c (rows x 16 int32, 64 bytes a row): A at x (row stride
// K), B at b (64 bytes a row); P picks the tiles, so that consecutive items overlap.
template <int P>
SPECD_AMX inline void item_dots(const int8_t* x, int64_t K, const uint8_t* b, int32_t* c) {
  if constexpr (P == 0) {
    _tile_loadd(0, x, K);
    _tile_loadd(1, b, 64);
    _tile_zero(2);
    _tile_dpbsud(2, 0, 1);
    _tile_stored(2, c, 64);
  } else {
    _tile_loadd(3, x, K);
    _tile_loadd(4, b, 64);
    _tile_zero(5);
    _tile_dpbsud(5, 3, 4);
    _tile_stored(5, c, 64);
  }
}

// A tile of 16 columns for R rows, as tile_rows, its integer dots on AMX. An item is a
// group (4 and 8 bits) or a half-group (6 bits: each half has its own scale). The tile
// unit reads memory that vector stores wrote, and vectors read what it stored, only once
// those stores have retired, so the work is a pipeline over the groups that
// for_each_group walks: at group g, unpack g's codes, take the dots of group g - AHEAD
// and apply the float terms of group g - AHEAD - LAG (in group order); the last groups'
// stages run after the walk.
template <int R, int BITS>
SPECD_AMX void tile_rows_amx(const uint8_t* wt, int64_t KG,
                             const int8_t* xq, const float* sx, const float* c,
                             const int32_t* halves, const int32_t* group_sums, int64_t K,
                             const float* bias, void* out, bool bf16_out, int64_t ldo, int64_t n0) {
  constexpr int ITEMS = BITS == 6 ? 2 : 1;  // per group
  constexpr int AHEAD = 2, LAG = 2, RING = 8;  // RING > AHEAD + LAG
  alignas(64) uint8_t codes[RING][512];  // 4 and 6 bits: the B tile's rows
  alignas(64) int32_t dots[RING][ITEMS][R * NT];
  const uint8_t* streams[RING];  // each group's codes in the stream (8 bits: B as it is)
  const uint8_t* heads[RING];    // its scales: 8 bits its record's, else its header
  __m512 acc[R];
  __m512i ai[R];  // 4 and 6 bits: the super-block's integer sums, as tile_rows'
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps(), ai[r] = _mm512_setzero_si512();
  auto take_dots = [&](int64_t g) {
    const uint8_t* b = BITS == 8 ? streams[g % RING] : codes[g % RING];
    const int8_t* x = xq + g * G;
    if constexpr (ITEMS == 2) {
      item_dots<0>(x, K, b, dots[g % RING][0]);
      item_dots<1>(x + G / 2, K, b + 256, dots[g % RING][1]);
    } else if (g & 1) {
      item_dots<1>(x, K, b, dots[g % RING][0]);
    } else {
      item_dots<0>(x, K, b, dots[g % RING][0]);
    }
  };
  auto add_terms = [&](int64_t g) {  // tile_rows' terms, on the tile's dots
    const uint8_t* head = heads[g % RING];
    if constexpr (BITS == 8) {
      __m512 dg, mg;
      group_scales(head, dg, mg);
      for (int r = 0; r < R; ++r)
        acc[r] = add_group(acc[r], _mm512_load_si512(dots[g % RING][0] + NT * r), dg, mg,
                              sx[r * KG + g], c[r * KG + g]);
    } else {
      const int64_t j = g % SB;
      __m512i sl, sh;
      int_scales<BITS>(head, j, sl, sh);
      for (int r = 0; r < R; ++r) {
        __m512i lo = _mm512_load_si512(dots[g % RING][0] + NT * r), hi = lo;
        if constexpr (BITS == 6) {  // the offsets, as group_rows_int starts its sums
          const int32_t* hs = halves + r * 2 * KG + 2 * g;
          lo = _mm512_add_epi32(_mm512_set1_epi32(-32 * hs[0]), lo);
          hi = _mm512_add_epi32(_mm512_set1_epi32(-32 * hs[1]), _mm512_load_si512(dots[g % RING][1] + NT * r));
        }
        ai[r] = add_int_group<BITS>(ai[r], lo, hi, sl, sh);
      }
      if (j == SB - 1 || g == KG - 1) super_block_rows<R, BITS>(acc, ai, head, j + 1, g - j, KG, sx, group_sums);
    }
  };
  for_each_group<BITS>(wt, KG, [&](const uint8_t* wg, const uint8_t* head, int64_t, int64_t g) {
    streams[g % RING] = wg;
    heads[g % RING] = head;
    if constexpr (BITS != 8) {
      __m512i w[8];
      unpack_group<BITS>(wg, w);
      for (int i = 0; i < 8; ++i) _mm512_store_si512(codes[g % RING] + 64 * i, w[i]);
    }
    if (g >= AHEAD) take_dots(g - AHEAD);
    if (g >= AHEAD + LAG) add_terms(g - AHEAD - LAG);
  });
  for (int64_t g = std::max<int64_t>(0, KG - AHEAD); g < KG; ++g) take_dots(g);
  for (int64_t g = std::max<int64_t>(0, KG - AHEAD - LAG); g < KG; ++g) add_terms(g);
  const __m512 bv = bias ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) store_row(_mm512_add_ps(acc[r], bv), out, bf16_out, r * ldo + n0);
}

// The tile unit, tried once on a group whose dots are known. Some hypervisors let the
// permission be granted and still fault at the first tile instruction (SIGILL: seen on
// an earlier machine of this project, docs/benchmarks-log.md section 14), so the try runs under
// a SIGILL handler that jumps back here; the process's own handler (Python's
// faulthandler, say) is put back after. SPECD_AMX_PROBE_FAULT=1 makes the try fault on
// purpose, for the test of that fallback.
sigjmp_buf amx_probe_exit;
void amx_probe_fault(int) { siglongjmp(amx_probe_exit, 1); }

SPECD_AMX bool amx_runs() {
  alignas(64) int8_t x[16 * G];
  alignas(64) uint8_t b[512];
  alignas(64) int32_t dots[16 * NT];
  for (int i = 0; i < 16 * G; ++i) x[i] = int8_t(i % 7 - 3);
  for (int i = 0; i < 512; ++i) b[i] = uint8_t(i % 5);
  struct sigaction fault = {}, saved = {};
  fault.sa_handler = amx_probe_fault;
  sigemptyset(&fault.sa_mask);
  sigaction(SIGILL, &fault, &saved);
  volatile bool ran = false;  // read after a jump back
  if (sigsetjmp(amx_probe_exit, 1) == 0) {
    if (std::getenv("SPECD_AMX_PROBE_FAULT")) asm volatile("ud2");
    configure_tiles(16, G);
    item_dots<0>(x, G, b, dots);
    _tile_release();
    ran = true;
  }
  sigaction(SIGILL, &saved, nullptr);
  if (!ran) return false;
  for (int r = 0; r < 16; ++r)  // dots[r][n] = sum_k x[r][k] q[n][k], B in vpdpbusd's order
    for (int n = 0; n < NT; ++n) {
      int32_t want = 0;
      for (int k = 0; k < G; ++k) want += int32_t(x[r * G + k]) * int32_t(b[(k / 4) * 64 + n * 4 + k % 4]);
      if (dots[r * NT + n] != want) return false;
    }
  return true;
}

// Whether this process may use AMX: the CPU has it, the OS grants the tile state (Linux
// asks each process to request it) and a tile operation runs and gives the right dots.
// SPECD_NO_AMX turns it off.
bool amx_granted() {
  static const bool granted = [] {
    if (std::getenv("SPECD_NO_AMX")) return false;
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 25)))
      return false;
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return false;
    return amx_runs();
  }();
  return granted;
}

#else  // AVX2: 8 columns per ymm, so a tile is two halves; the same sums as above

// fp32 -> bf16 as store_row above, 8 values
inline void store8(__m256 v, void* out, bool bf16_out, int64_t offset) {
  if (!bf16_out) {
    _mm256_storeu_ps(static_cast<float*>(out) + offset, v);
    return;
  }
  _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + offset),
                   bf16_from_floats8(v));
}

// sum_j dot4(w[j], x[j]) per 32-bit lane (one column) as two int16 halves, exact, for
// weights < 16: vpmaddubsw (u8 x s8) sums adjacent pairs into int16, at most 2 * 15 * 127
// = 3810 (it saturates only past 32767), and the eight vectors of a group together stay
// under 8 * 3810 = 30480, so they add in int16.
inline __m256i nibble_pairs(const __m256i* w, const int32_t* x) {
  __m256i s = _mm256_maddubs_epi16(w[0], _mm256_set1_epi32(x[0]));
  for (int j = 1; j < 8; ++j) s = _mm256_add_epi16(s, _mm256_maddubs_epi16(w[j], _mm256_set1_epi32(x[j])));
  return s;
}

// the same summed into int32 (vpmaddwd with ones): 8 bits' two nibble dots
inline __m256i dot_nibbles(const __m256i* w, const int32_t* x) {
  return _mm256_madd_epi16(nibble_pairs(w, x), _mm256_set1_epi16(1));
}

// 6-bit weights (< 64) over one half-group (four vectors), each column's sum times its
// scale: a pair of vpmaddubsw sums at most 2 * 2 * 63 * 127 = 32004, still exact in int16,
// so pairs go to int32 under the scale (vpmaddwd) and add there.
inline __m256i dot_six_half(const __m256i* w, const int32_t* x, __m256i scale) {
  __m256i acc = _mm256_setzero_si256();
  for (int j = 0; j < 4; j += 2) {
    const __m256i s = _mm256_add_epi16(_mm256_maddubs_epi16(w[j], _mm256_set1_epi32(x[j])),
                                       _mm256_maddubs_epi16(w[j + 1], _mm256_set1_epi32(x[j + 1])));
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(s, scale));
  }
  return acc;
}

// A half-tile's codes of one group (columns 8h .. 8h + 7: bytes 32h .. 32h + 31 of each
// vector). 4 and 6 bits: lo[j] = the codes of k = 4j..4j+3, 6 bits with their top two bits
// at bits 4, 5. 8 bits: q = lo + 16 hi, two nibble dots.
template <int BITS>
inline void unpack_half(const uint8_t* wg, int h, __m256i* lo, __m256i* hi) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int j = 0; j < 8; ++j) {
    if (BITS != 8 && j % 2) continue;
    const int64_t at = BITS == 8 ? 64 * j : 64 * (j / 2);
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + at + 32 * h));
    const __m256i vhi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    lo[j] = _mm256_and_si256(v, low4);
    if constexpr (BITS == 8)
      hi[j] = vhi;
    else
      lo[j + 1] = vhi;
  }
  if constexpr (BITS == 6) {
    // the top bits of vector 4t + i sit at bits 2i, 2i + 1 of each byte of vector t:
    // shifted to bits 4, 5 (16-bit shifts, masked per byte: nothing crosses a byte)
    const __m256i top = _mm256_set1_epi8(0x30);
    for (int t = 0; t < 2; ++t) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + 256 + 64 * t + 32 * h));
      lo[4 * t] = _mm256_or_si256(lo[4 * t], _mm256_and_si256(_mm256_slli_epi16(v, 4), top));
      lo[4 * t + 1] = _mm256_or_si256(lo[4 * t + 1], _mm256_and_si256(_mm256_slli_epi16(v, 2), top));
      lo[4 * t + 2] = _mm256_or_si256(lo[4 * t + 2], _mm256_and_si256(v, top));
      lo[4 * t + 3] = _mm256_or_si256(lo[4 * t + 3], _mm256_and_si256(_mm256_srli_epi16(v, 2), top));
    }
  }
}

// A header's 8 integers for the half-tile's columns (at p: uint8 for 4 bits' s and t, int8
// for 6 bits' sc), one per column, as the int16 pair vpmaddwd takes: (p[c], p[c]), or with
// `q` (p[c], q[c]). One byte shuffle per 128-bit lane (columns 0-3, then 4-7) puts each
// byte in an int16's high half; an arithmetic or a logical shift brings it down, signed or
// not.
template <bool SIGNED>
inline __m256i int16_pairs(const uint8_t* p, const uint8_t* q = nullptr) {
  int64_t lo, hi;
  std::memcpy(&lo, p, 8);
  std::memcpy(&hi, q ? q : p, 8);
  const __m256i v = _mm256_set_epi64x(hi, lo, hi, lo);  // each lane: p's 8 bytes, then q's
  const __m256i place = _mm256_setr_epi8(
      -128, 0, -128, 8, -128, 1, -128, 9, -128, 2, -128, 10, -128, 3, -128, 11,
      -128, 4, -128, 12, -128, 5, -128, 13, -128, 6, -128, 14, -128, 7, -128, 15);
  const __m256i high = _mm256_shuffle_epi8(v, place);
  return SIGNED ? _mm256_srai_epi16(high, 8) : _mm256_srli_epi16(high, 8);
}

// 8 bits: one group of a tile's 16 columns into acc[r][h] for every row, its scales dg[h]
// and mins mg[h] (columns 8h .. 8h + 7) as floats
template <int R>
inline void group_rows8(__m256 (*acc)[2], const uint8_t* wg, const __m256* dg, const __m256* mg,
                        int64_t g, int64_t KG, const int8_t* xq, const float* sx, const float* c,
                        int64_t K) {
  for (int h = 0; h < 2; ++h) {
    __m256i lo[8], hi[8];
    unpack_half<8>(wg, h, lo, hi);
    // The row loops stay rolled (here and below): the codes lo[] hold 8 of the 16 ymm
    // registers, and an unrolled loop of 2-7 rows spilled them and the accumulators
    // around every row. Rolled, a row's accumulator is one load and one store per group
    // (docs/benchmarks-log.md section 39); the operations per row are the same, so the results too.
#pragma GCC unroll 1
    for (int r = 0; r < R; ++r) {
      const auto* xg = reinterpret_cast<const int32_t*>(xq + r * K + g * G);
      const __m256i dot = _mm256_add_epi32(dot_nibbles(lo, xg), _mm256_slli_epi32(dot_nibbles(hi, xg), 4));
      const __m256 scale = _mm256_mul_ps(dg[h], _mm256_set1_ps(sx[r * KG + g]));
      acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[r][h]);
      acc[r][h] = _mm256_fnmadd_ps(mg[h], _mm256_set1_ps(c[r * KG + g]), acc[r][h]);
    }
  }
}

// 4 and 6 bits: one group (j-th of its super-block, header `head`) into the integer sums
// ai[r][h] for every row. The weights' integer scales go in as vpmaddwd's pairs, so a
// super-block's sum stays exact in int32: 4 bits sum_j s_j dot_j, at most 8 * 63 * 30480
// < 2^24; 6 bits sum_h sc_h dot_h, at most 16 * 128 * 16 * 63 * 127 < 2^28.
template <int R, int BITS>
inline void group_rows_int(__m256i (*ai)[2], const uint8_t* wg, const uint8_t* head, int64_t j,
                           int64_t g, const int8_t* xq, int64_t K) {
  for (int h = 0; h < 2; ++h) {
    __m256i lo[8];
    unpack_half<BITS>(wg, h, lo, nullptr);
    if constexpr (BITS == 4) {
      const uint8_t* s = head + 64 + NT * j + 8 * h;  // s_j of the 8 columns
      const __m256i scale = int16_pairs<false>(s);
#pragma GCC unroll 1
      for (int r = 0; r < R; ++r) {
        const auto* xg = reinterpret_cast<const int32_t*>(xq + r * K + g * G);
        ai[r][h] = _mm256_add_epi32(ai[r][h], _mm256_madd_epi16(nibble_pairs(lo, xg), scale));
      }
    } else {  // vectors 0-3 are the low half-group, 4-7 the high, each with its sc
      const uint8_t* sc = head + 64 + 2 * NT * j + 8 * h;
      const __m256i slo = int16_pairs<true>(sc), shi = int16_pairs<true>(sc + NT);
#pragma GCC unroll 1
      for (int r = 0; r < R; ++r) {
        const auto* xg = reinterpret_cast<const int32_t*>(xq + r * K + g * G);
        ai[r][h] = _mm256_add_epi32(ai[r][h], _mm256_add_epi32(dot_six_half(lo, xg, slo),
                                                               dot_six_half(lo + 4, xg + 4, shi)));
      }
    }
  }
}

// 4 and 6 bits, at the end of a super-block of `groups` groups from g0 (header `head`):
// its float terms for every row, once, from the integer sums, and the sums cleared.
// With the block's activation scale sx, pairs[r][g] = the sums (lo, hi) of group g's two
// 16-blocks of codes and group_sums the sums of whole groups, as int16:
//     4 bits: acc += D sx ai - M sx sum_j t_j sum_j
//     6 bits: acc += D sx (ai - 32 sum_j (sc_2j lo_j + sc_2j+1 hi_j))   (w = D sc (q - 32))
// the second sums exact in int32 too (at most 8 * 63 * 4064, and 16 * 127 * 2032 * 32).
template <int R, int BITS>
inline void super_block_rows(__m256 (*acc)[2], __m256i (*ai)[2], const uint8_t* head,
                             int64_t groups, int64_t g0, int64_t KG, const float* sx,
                             const int32_t* pairs, const int32_t* group_sums) {
  const auto* dm = reinterpret_cast<const __m128i*>(head);
  for (int h = 0; h < 2; ++h) {
    const __m256 D = _mm256_cvtph_ps(_mm_loadu_si128(dm + h));
    const __m256 M = _mm256_cvtph_ps(_mm_loadu_si128(dm + 2 + h));
    // 4 bits: per two groups the pair (t_2i, t_2i+1) that multiplies (sum_2i, sum_2i+1), the
    // integers past a short last super-block zero (the header's) as are the sums past a
    // row's last group (pairs_of); 6 bits: per group (sc_2j, sc_2j+1) for (lo_j, hi_j)
    const int64_t units = BITS == 4 ? (groups + 1) / 2 : groups;
    __m256i wm[SB];
    for (int64_t i = 0; i < units; ++i) {
      if constexpr (BITS == 4) {
        const uint8_t* t = head + 64 + NT * (SB + 2 * i) + 8 * h;
        wm[i] = int16_pairs<false>(t, t + NT);
      } else {
        const uint8_t* sc = head + 64 + 2 * NT * i + 8 * h;
        wm[i] = int16_pairs<true>(sc, sc + NT);
      }
    }
#pragma GCC unroll 1
    for (int r = 0; r < R; ++r) {
      const int32_t* pr = BITS == 4 ? group_sums + r * pairs_of(KG) + g0 / 2 : pairs + r * KG + g0;
      __m256i mi = _mm256_madd_epi16(wm[0], _mm256_set1_epi32(pr[0]));
      for (int64_t i = 1; i < units; ++i)
        mi = _mm256_add_epi32(mi, _mm256_madd_epi16(wm[i], _mm256_set1_epi32(pr[i])));
      const __m256 s = _mm256_set1_ps(sx[r * KG + g0]);
      if constexpr (BITS == 4) {
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ai[r][h]), _mm256_mul_ps(D, s), acc[r][h]);
        acc[r][h] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mi), _mm256_mul_ps(M, s), acc[r][h]);
      } else {
        const __m256i dot = _mm256_sub_epi32(ai[r][h], _mm256_slli_epi32(mi, 5));
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(D, s), acc[r][h]);
      }
      ai[r][h] = _mm256_setzero_si256();
    }
  }
}

template <int R, int BITS>
__attribute__((noinline)) void tile_rows(const uint8_t* wt, int64_t KG,
               const int8_t* xq, const float* sx, const float* c, const int32_t* pairs,
               const int32_t* group_sums, int64_t K, const float* bias, void* out, bool bf16_out,
               int64_t ldo, int64_t n0) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  if constexpr (BITS == 8) {
    for_each_group<8>(wt, KG, [&](const uint8_t* wg, const uint8_t* head, int64_t, int64_t g) {
      const auto* dm = reinterpret_cast<const __m128i*>(head);
      __m256 dg[2], mg[2];  // the record's fp16 d and m
      for (int h = 0; h < 2; ++h) {
        dg[h] = _mm256_cvtph_ps(_mm_loadu_si128(dm + h));
        mg[h] = _mm256_cvtph_ps(_mm_loadu_si128(dm + 2 + h));
      }
      group_rows8<R>(acc, wg, dg, mg, g, KG, xq, sx, c, K);
    });
  } else {
    __m256i ai[R][2];
    for (int r = 0; r < R; ++r) ai[r][0] = ai[r][1] = _mm256_setzero_si256();
    for_each_group<BITS>(wt, KG, [&](const uint8_t* wg, const uint8_t* head, int64_t j, int64_t g) {
      group_rows_int<R, BITS>(ai, wg, head, j, g, xq, K);
      if (j == SB - 1 || g == KG - 1)
        super_block_rows<R, BITS>(acc, ai, head, j + 1, g - j, KG, sx, pairs, group_sums);
    });
  }
  for (int h = 0; h < 2; ++h) {
    const __m256 b = bias ? _mm256_loadu_ps(bias + n0 + 8 * h) : _mm256_setzero_ps();
    for (int r = 0; r < R; ++r)
      store8(_mm256_add_ps(acc[r][h], b), out, bf16_out, r * ldo + n0 + 8 * h);
  }
}

#endif  // __AVX512VNNI__

// A call's quantised activations (codes, scales, scale * sum, 6 bits' half-sums) and its
// output, from row r0 on
struct Rows {
  const int8_t* xq;
  const float* sx;
  const float* c;
  const int32_t* halves;
  const int32_t* group_sums;  // 4 bits: pairs_of(KG) words a row
  void* out;
  int64_t K, KG, ldo, esize;

  Rows from(int64_t r0) const {
    return {xq + r0 * K, sx + r0 * KG, c + r0 * KG, halves ? halves + r0 * HALF_WORDS * KG : nullptr,
            group_sums ? group_sums + r0 * pairs_of(KG) : nullptr,
            static_cast<char*>(out) + r0 * ldo * esize, K, KG, ldo, esize};
  }
};

template <int BITS>
void tile_all_rows(int rows, const uint8_t* wt, const Rows& all, const float* bias, bool bf16_out,
                   int64_t n0) {
  for (int r0 = 0; r0 < rows; r0 += RMAX) {
    const int n = std::min(RMAX, rows - r0);
    const Rows a = all.from(r0);
#define SPECD_ROWS(R)                                                                      \
  case R:                                                                                  \
    tile_rows<R, BITS>(wt, a.KG, a.xq, a.sx, a.c, a.halves, a.group_sums, a.K, bias, a.out, bf16_out, a.ldo, \
                       n0);                                                                \
    break;
    switch (n) {
      SPECD_ROWS(1) SPECD_ROWS(2) SPECD_ROWS(3) SPECD_ROWS(4)
      SPECD_ROWS(5) SPECD_ROWS(6) SPECD_ROWS(7) SPECD_ROWS(8)
    }
#undef SPECD_ROWS
  }
}

#if defined(__AVX512VNNI__)
// every tile of [t0, t1) for `rows` rows (a multiple of `block`, which is at most 16), with
// the tiles configured once for the thread
template <int BITS>
SPECD_AMX void tiles_amx(int64_t t0, int64_t t1, int64_t per_tile, int block, int rows,
                         const uint8_t* w, const Rows& all, const float* bias, bool bf16_out) {
  configure_tiles(block, BITS == 6 ? G / 2 : G);
  for (int64_t t = t0; t < t1; ++t) {
    for (int r0 = 0; r0 < rows; r0 += block) {
      const Rows a = all.from(r0);
#define SPECD_ROWS(R)                                                                         \
  case R:                                                                                     \
    tile_rows_amx<R, BITS>(w + t * per_tile, a.KG, a.xq, a.sx, a.c, a.halves, a.group_sums, a.K, bias, a.out, \
                           bf16_out, a.ldo, t * NT);                                          \
    break;
      switch (block) {
        SPECD_ROWS(1) SPECD_ROWS(2) SPECD_ROWS(3) SPECD_ROWS(4)
        SPECD_ROWS(5) SPECD_ROWS(6) SPECD_ROWS(7) SPECD_ROWS(8)
        SPECD_ROWS(9) SPECD_ROWS(10) SPECD_ROWS(11) SPECD_ROWS(12)
        SPECD_ROWS(13) SPECD_ROWS(14) SPECD_ROWS(15) SPECD_ROWS(16)
      }
#undef SPECD_ROWS
    }
  }
  _tile_release();
}
#endif

// calls of at least this many rows take the AMX path where it is granted (0: never). Below
// it the vector path is as fast or faster: at up to 8 rows (one register block) a group's
// 8 R vpdpbusd cost less than the tile unit's loads, dot and store; past 8 the vector path
// walks each tile once per block of 8 rows (docs/benchmarks-log.md section 36).
int64_t amx_min_rows = RMAX + 1;

}  // namespace

// Groups per activation block for weights of `bits` (quantize_rows): 4 and 6 bits a
// super-block's 8, which their integer sums need (+0.11% NLL on the 1.5B, docs/benchmarks-log.md
// section 47); 8 bits one group, the finer scale, where the float terms are per group
// anyway (the drafter's int8 lost cosine to bf16 at 8).
int64_t act_groups(int64_t bits) { return bits != 8 ? SB : 1; }

int64_t activation_block(int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 6 || bits == 8, "bits must be 4, 6 or 8");
  return act_groups(bits) * G;
}

bool amx_available() {
#if defined(__AVX512VNNI__)
  return amx_granted();
#else
  return false;
#endif
}

int64_t set_amx_min_rows(int64_t rows) {
  TORCH_CHECK(rows >= 0, "rows must be >= 0");
  return std::exchange(amx_min_rows, rows);
}

namespace {

// A call's activations, quantised once for every matrix of one activation block size that
// reads them (a fused matrix's parts share them: the same codes the separate calls would
// make): codes, scales, scale * sum and the 16-block sums in one allocation
struct Acts {
  at::Tensor buffer;
  const int8_t* xq = nullptr;
  const float* sx = nullptr;
  const float* c = nullptr;
  const int32_t* halves = nullptr;  // store_halves' (6 bits; else null)
  const int32_t* group_sums = nullptr;  // pairs_of's (4 bits' super-block sums; else null)
  int64_t M = 0, K = 0, rows_run = 0;
  int block = 0;  // AMX: rows per block (0: the vector path)
};

// `per_block` groups to a scale; `six`, `four`: whether 6- or 4-bit parts read these
Acts quantize_acts(const at::Tensor& x, int64_t per_block, bool six, bool four) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [M, K] matrix");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "x must be fp32 or bf16");
  const int64_t M = x.size(0), K = x.size(1), KG = K / G;
  TORCH_CHECK(K % G == 0, "weight layout does not match x");
  Acts a;
  a.M = M, a.K = K, a.rows_run = M;
#if defined(__AVX512VNNI__)
  // AMX: blocks of at most 16 rows, all of one size (the tiles are configured once), the
  // last padded with zero rows
  if (amx_min_rows > 0 && M >= amx_min_rows && amx_granted()) {
    const int64_t blocks = (M + AMX_ROWS - 1) / AMX_ROWS;
    a.block = int((M + blocks - 1) / blocks);
    a.rows_run = blocks * a.block;
  }
#endif
  // AVX2: every row count runs as it is (the row loops are rolled at every block size, so
  // 7 rows no longer compile to slower code than 8 and need no padding row).
  const bool halves = six;
  const auto padded = [](int64_t bytes) { return (bytes + 63) / 64 * 64; };
  const int64_t R = a.rows_run, xq_bytes = padded(R * K), f_bytes = padded(R * KG * 4);
  const int64_t h_bytes = halves ? padded(R * KG * HALF_WORDS * 4) : 0;
  const int64_t s_bytes = four ? R * pairs_of(KG) * 4 : 0;
  a.buffer = at::empty({xq_bytes + 2 * f_bytes + h_bytes + s_bytes}, x.options().dtype(at::kByte));
  auto* base = a.buffer.data_ptr<uint8_t>();
  auto* xq = reinterpret_cast<int8_t*>(base);
  auto* sx = reinterpret_cast<float*>(base + xq_bytes);
  auto* c = reinterpret_cast<float*>(base + xq_bytes + f_bytes);
  auto* hs = halves ? reinterpret_cast<int32_t*>(base + xq_bytes + 2 * f_bytes) : nullptr;
  auto* gs = s_bytes ? reinterpret_cast<int32_t*>(base + xq_bytes + 2 * f_bytes + h_bytes) : nullptr;
  a.xq = xq, a.sx = sx, a.c = c, a.halves = hs, a.group_sums = gs;
  if (M == 0) return a;
  quantize_rows(x, per_block, xq, sx, c, hs, reinterpret_cast<int16_t*>(gs));
  if (R > M) {  // AMX's padding rows
    std::memset(xq + M * K, 0, (R - M) * K);
    std::memset(sx + M * KG, 0, (R - M) * KG * 4);
    std::memset(c + M * KG, 0, (R - M) * KG * 4);
    if (hs) std::memset(hs + M * KG * HALF_WORDS, 0, (R - M) * KG * HALF_WORDS * 4);
    if (gs) std::memset(gs + M * pairs_of(KG), 0, (R - M) * pairs_of(KG) * 4);
  }
  return a;
}

// One matrix of a call: its records, width, bias (fp32 or null), first output column and
// the activations it reads
struct Part {
  const uint8_t* w;
  int64_t tiles, per_tile, bits;
  const float* bias;
  int64_t col;
  const Acts* acts;
};

// a part's records checked against x's width; its bias is set by the caller
Part check_part(const Acts& a, const at::Tensor& records, int64_t bits, int64_t col) {
  const int64_t KG = a.K / G;
  const bool fits = bits == 8
      ? records.dim() == 3 && records.size(1) == KG && records.size(2) == record_bytes<8>()
      : records.dim() == 2 && records.size(1) == tile_bytes(KG, bits);
  TORCH_CHECK(fits, "weight layout does not match x");
  TORCH_CHECK(records.is_contiguous() && records.scalar_type() == at::kByte,
              "weights must be contiguous uint8 records");
  return {records.data_ptr<uint8_t>(), records.size(0), records.stride(0), bits, nullptr, col, &a};
}

// Every tile of every part in one parallel region (threads split the tiles of all parts
// as one range: columns only, so a row's result never depends on the other rows), each
// part writing its own columns of `y` [rows_run, ldo] from its activations.
void run_parts(const std::vector<Part>& parts, at::Tensor& y) {
  const Acts& a = *parts[0].acts;  // the shape and AMX's blocks are those of every part's
  const bool bf16_out = y.scalar_type() == at::kBFloat16;
  const int64_t esize = bf16_out ? 2 : 4, ldo = y.size(1), KG = a.K / G;
  std::vector<int64_t> first{0};
  for (const Part& p : parts) first.push_back(first.back() + p.tiles);
  char* out = static_cast<char*>(y.data_ptr());
  const int rows = int(a.rows_run);
  at::parallel_for(0, first.back(), 1, [&](int64_t t0, int64_t t1) {
    for (size_t i = 0; i < parts.size(); ++i) {
      const Part& p = parts[i];
      const int64_t lo = std::max(t0, first[i]) - first[i], hi = std::min(t1, first[i + 1]) - first[i];
      if (lo >= hi) continue;
      const Acts& x = *p.acts;
      const Rows all{x.xq, x.sx, x.c, x.halves, x.group_sums, out + p.col * esize, a.K, KG, ldo, esize};
#if defined(__AVX512VNNI__)
      if (a.block) {
        if (p.bits == 4)
          tiles_amx<4>(lo, hi, p.per_tile, a.block, rows, p.w, all, p.bias, bf16_out);
        else if (p.bits == 6)
          tiles_amx<6>(lo, hi, p.per_tile, a.block, rows, p.w, all, p.bias, bf16_out);
        else
          tiles_amx<8>(lo, hi, p.per_tile, a.block, rows, p.w, all, p.bias, bf16_out);
        continue;
      }
#endif
      for (int64_t t = lo; t < hi; ++t) {
        const uint8_t* wt = p.w + t * p.per_tile;
        if (p.bits == 4)
          tile_all_rows<4>(rows, wt, all, p.bias, bf16_out, t * NT);
        else if (p.bits == 6)
          tile_all_rows<6>(rows, wt, all, p.bias, bf16_out, t * NT);
        else
          tile_all_rows<8>(rows, wt, all, p.bias, bf16_out, t * NT);
      }
    }
  });
}

}  // namespace

// x [M, K] fp32 or bf16; each of `records` uint8 [N_i/16, K/32, 512 code bytes + 64] (8
// bits) or [N_i/16, tile_bytes(K/32, bits_i)] (4 and 6 bits); bias fp32 [sum N_i] or empty.
// Returns [M, sum N_i] in `out_dtype` (fp32 or bf16): the parts' outputs side by side, as
// their separate calls concatenated would be, bit for bit (x quantised once for each
// activation block size the parts take, one parallel region).
at::Tensor qlinear_parts(const at::Tensor& x, const std::vector<at::Tensor>& records,
                         const std::vector<int64_t>& bits, const at::Tensor& bias,
                         at::ScalarType out_dtype) {
  TORCH_CHECK(!records.empty() && records.size() == bits.size(), "one width per part");
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16, "out must be fp32 or bf16");
  for (const int64_t b : bits) TORCH_CHECK(b == 4 || b == 6 || b == 8, "bits must be 4, 6 or 8");
  Acts by_block[2];  // x quantised once per activation block size the parts take (act_groups)
  int64_t blocks[2] = {0, 0};
  const auto acts_for = [&](int64_t b) -> const Acts& {
    const int64_t groups = act_groups(b);
    const int i = blocks[0] == groups || blocks[0] == 0 ? 0 : 1;
    if (blocks[i] != groups) {
      const auto reads = [&](int64_t width) {  // a part of this width reads these
        return act_groups(width) == groups && std::find(bits.begin(), bits.end(), width) != bits.end();
      };
      blocks[i] = groups;
      by_block[i] = quantize_acts(x, groups, reads(6), reads(4));
    }
    return by_block[i];
  };
  std::vector<Part> parts;
  int64_t N = 0;
  for (size_t i = 0; i < records.size(); ++i) {
    parts.push_back(check_part(acts_for(bits[i]), records[i], bits[i], N));
    N += parts.back().tiles * NT;
  }
  const Acts& a = by_block[0];
  TORCH_CHECK(!bias.defined() || bias.numel() == 0 || bias.numel() == N, "bias size");
  if (bias.defined() && bias.numel())
    for (Part& p : parts) p.bias = bias.data_ptr<float>() + p.col;
  if (a.M == 0) return at::empty({0, N}, x.options().dtype(out_dtype));
  auto y = at::empty({a.rows_run, N}, x.options().dtype(out_dtype));
  run_parts(parts, y);
  return a.rows_run == a.M ? y : y.narrow(0, 0, a.M);
}

// one matrix: qlinear_parts of one part
at::Tensor qlinear(const at::Tensor& x, const at::Tensor& records, const at::Tensor& bias,
                   int64_t bits, at::ScalarType out_dtype) {
  return qlinear_parts(x, {records}, {bits}, bias, out_dtype);
}
