// Attention of a few new queries per sequence over a paged K/V cache (decode: 1 query,
// verification: k+1 chain or tree queries), read in place from the block pool.
//
// For query row r of sequence b, kv head g and each query head h of g's group:
//     s_j = scale * dot(q[r][h], K[slot_b(j)][g])        for every key j row r may see
//     out[r][h] = sum_j exp(s_j - max s) * V[slot_b(j)][g] / sum_j exp(s_j - max s)
// Row r sees keys j < limit[r] and, for tree rows, key limit[r] + i when bit i of tree[r]
// is set (its ancestors among the new tokens). slot_b(j) = table[b][j / bs] * bs + j % bs.
//
// Batch invariance by construction: every (row, head) has its own accumulators and visits
// its keys in increasing j with the same instructions, so a row's result does not depend
// on how many other rows (of its sequence or of the batch) share the call, nor on which
// thread runs it. Dots and sums are fp32 in vectors of 16 (one zmm with AVX512, two ymm
// with AVX2: the helpers below are all that differs); exp is a degree-6 polynomial.
//
// Keys go in blocks of 16, each block's K and V widened to fp32 once for every row and
// head of the call. A row that sees a whole block gets its 16 scores summed together
// (sum16 on AVX512), in the same tree of additions as one score at a time (vsum), and its
// weighted values added with the accumulators in registers across the block, in the same
// order: which way a score or a sum went never changes its bits. (Before, the values'
// accumulators took a load and a store per key, ~3x the FMAs' time at 7 rows.)

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "bf16.h"
#include "exp_poly.h"
#include "kv_dtypes.h"
#include "reduce.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

#if defined(__AVX512F__)
using V = __m512;  // 16 floats
inline V vzero() { return _mm512_setzero_ps(); }
inline V vset(float x) { return _mm512_set1_ps(x); }
inline V vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, V v) { _mm512_storeu_ps(p, v); }
inline V vadd(V a, V b) { return _mm512_add_ps(a, b); }
inline V vsub(V a, V b) { return _mm512_sub_ps(a, b); }
inline V vmul(V a, V b) { return _mm512_mul_ps(a, b); }
inline V vmax(V a, V b) { return _mm512_max_ps(a, b); }
inline V vfmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V vfnmadd(V a, V b, V c) { return _mm512_fnmadd_ps(a, b, c); }
inline V vround(V x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline V vpow2_mul(V p, V n) { return _mm512_scalef_ps(p, n); }  // p * 2^n, n integral
// the sum of the 16 lanes in a fixed tree: lanes 8 apart first, then 4, 2 and 1 (AVX2's
// vsum below adds in the same tree, and so does GCC's _mm512_reduce_add_ps)
inline float vsum(V v) {
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  return hsum8(_mm256_add_ps(_mm512_castps512_ps256(v), hi));
}
// vsum of 16 vectors at once, out[t] = vsum(a[t]), in the same tree: each level adds the
// lanes that vsum's does, for two keys per shuffle pair, until one vector holds all 16
inline V sum16(const V* a) {
  V p[8], r[4], u[2];
  for (int i = 0; i < 8; ++i)  // lane l + lane l + 8: keys 2i, 2i+1 by 256-bit halves
    p[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // + lane l + 4: key 4i + c in 128-bit chunk c
    r[i] = _mm512_add_ps(_mm512_shuffle_f32x4(p[2 * i], p[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(p[2 * i], p[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // + lane l + 2: chunk c holds keys 8i + c and 8i + 4 + c
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(r[2 * i], r[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(r[2 * i], r[2 * i + 1], 0xEE));
  // + lane l + 1: chunk c holds keys c, 4 + c, 8 + c, 12 + c; then back to key order
  const V s = _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], 0x88), _mm512_shuffle_ps(u[0], u[1], 0xDD));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, s);
}
inline float vtop(V v) { return _mm512_reduce_max_ps(v); }
inline __mmask16 lanes(int64_t live) { return live >= 16 ? 0xFFFF : __mmask16((1u << live) - 1); }
// p[0 .. live) and `fill` in the other lanes; v with the lanes from `live` on zeroed
inline V vhead(const float* p, int64_t live, float fill) {
  return _mm512_mask_loadu_ps(_mm512_set1_ps(fill), lanes(live), p);
}
inline V vkeep(V v, int64_t live) { return _mm512_maskz_mov_ps(lanes(live), v); }

template <typename T>
inline V load16(const T* p);
template <>
inline V load16<float>(const float* p) { return _mm512_loadu_ps(p); }
template <>
inline V load16<at::BFloat16>(const at::BFloat16* p) {
  return floats_from_bf16_16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
template <>
inline V load16<at::Half>(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

template <typename T>
inline void store16(T* p, V v);
template <>
inline void store16<float>(float* p, V v) { _mm512_storeu_ps(p, v); }
template <>
inline void store16<at::BFloat16>(at::BFloat16* p, V v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_from_floats16(v));
}

#else  // AVX2 (+ FMA, F16C): 16 floats as two ymm, lanes 0-7 and 8-15
struct V {
  __m256 lo, hi;
};
template <typename F>
inline V both(V a, V b, F f) { return {f(a.lo, b.lo), f(a.hi, b.hi)}; }
inline V vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V vset(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline V vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void vstore(float* p, V v) { _mm256_storeu_ps(p, v.lo); _mm256_storeu_ps(p + 8, v.hi); }
inline V vadd(V a, V b) { return both(a, b, [](__m256 x, __m256 y) { return _mm256_add_ps(x, y); }); }
inline V vsub(V a, V b) { return both(a, b, [](__m256 x, __m256 y) { return _mm256_sub_ps(x, y); }); }
inline V vmul(V a, V b) { return both(a, b, [](__m256 x, __m256 y) { return _mm256_mul_ps(x, y); }); }
inline V vmax(V a, V b) { return both(a, b, [](__m256 x, __m256 y) { return _mm256_max_ps(x, y); }); }
inline V vfmadd(V a, V b, V c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline V vfnmadd(V a, V b, V c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
inline V vround(V x) {
  constexpr int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(x.lo, mode), _mm256_round_ps(x.hi, mode)};
}
// p * 2^n for integral n >= -126 (exp_nonpositive clamps there): 2^n built in the exponent
// field, then one rounding of the exact product, as scalef
inline __m256 pow2_mul8(__m256 p, __m256 n) {
  const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(e, 23)));
}
inline V vpow2_mul(V p, V n) { return {pow2_mul8(p.lo, n.lo), pow2_mul8(p.hi, n.hi)}; }
inline float vsum(V v) { return hsum8(_mm256_add_ps(v.lo, v.hi)); }
inline float vtop(V v) { return hmax8(_mm256_max_ps(v.lo, v.hi)); }
inline __m256 lanes8(int64_t live) {  // all-ones in lanes i < live
  const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmp_ps(lane, _mm256_set1_ps(float(live)), _CMP_LT_OQ);
}
inline V vhead(const float* p, int64_t live, float fill) {
  const __m256 f = _mm256_set1_ps(fill);
  return {_mm256_blendv_ps(f, _mm256_loadu_ps(p), lanes8(live)),
          _mm256_blendv_ps(f, _mm256_loadu_ps(p + 8), lanes8(live - 8))};
}
inline V vkeep(V v, int64_t live) {
  return {_mm256_and_ps(v.lo, lanes8(live)), _mm256_and_ps(v.hi, lanes8(live - 8))};
}

inline void store8_bf16(at::BFloat16* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bf16_from_floats8(v));
}

template <typename T>
inline V load16(const T* p);
template <>
inline V load16<float>(const float* p) { return vload(p); }
template <>
inline V load16<at::BFloat16>(const at::BFloat16* p) { return {load8_bf16(p), load8_bf16(p + 8)}; }
template <>
inline V load16<at::Half>(const at::Half* p) { return {load8_half(p), load8_half(p + 8)}; }

template <typename T>
inline void store16(T* p, V v);
template <>
inline void store16<float>(float* p, V v) { vstore(p, v); }
template <>
inline void store16<at::BFloat16>(at::BFloat16* p, V v) {
  store8_bf16(p, v.lo);
  store8_bf16(p + 8, v.hi);
}
#endif

// exp(x) for x <= 0: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by its Taylor polynomial to r^6
// (relative error < 2e-7 there), times 2^n.
inline V exp_nonpositive(V x) {
  using namespace exp_poly;
  x = vmax(x, vset(MIN_X));
  const V n = vround(vmul(x, vset(LOG2E)));
  V r = vfnmadd(n, vset(LN2_HI), x);
  r = vfnmadd(n, vset(LN2_LO), r);
  V p = vset(C[0]);
  for (int i = 1; i <= DEGREE; ++i) p = vfmadd(p, r, vset(C[i]));
  return vpow2_mul(p, n);
}

inline bool sees(int64_t j, int64_t limit, uint64_t tree) {
  if (j < limit) return true;
  const int64_t i = j - limit;
  return i < 64 && ((tree >> i) & 1u);
}

inline int64_t reach(int64_t limit, uint64_t tree) {  // one past the last key seen
  return tree ? limit + 64 - __builtin_clzll(tree) : limit;
}

// A task's scores (rows x query heads x keys, fp32) are written in one pass over the keys
// and read in two more: they are kept within about this many bytes, in L2, by giving a
// sequence's rows to tasks of at most `tile_rows` rows (a long prefill chunk's 512 rows
// at 2,000 keys would otherwise write 24 MiB between its passes). Rows are independent,
// so how they are split changes no bits.
constexpr int64_t SCORE_BYTES = 256 << 10;
constexpr int64_t MIN_TILE = 16;  // rows: a verification's are never split
inline int64_t tile_rows(int64_t group, int64_t end) {
  return std::max<int64_t>(MIN_TILE, SCORE_BYTES / (int64_t(sizeof(float)) * group * (end + 16)));
}

// Keys are read from blocks scattered over the pool, a few hundred bytes per key and head
// (the other heads' between), and each 4 KiB page holds a handful of them: the hardware
// prefetchers barely start on one before it ends, and a decode row's few FMAs per key
// wait on memory. So each key's row is fetched AHEAD keys before it is used (~4 KiB at
// head_dim 128 in bf16; docs/benchmarks-log.md section 49).
constexpr int64_t AHEAD = 16;
constexpr int64_t KEY_BLOCK = 16;  // keys widened to fp32 together (see attend)
// accumulator vectors one (row, head) keeps in registers across a block: 8 zmm, or 4 V of
// two ymm each (AVX2 has 16 ymm registers)
#if defined(__AVX512F__)
constexpr int WIDE_ACC = 8;
#else
constexpr int WIDE_ACC = 4;
#endif
template <bool TO_L1, typename KV>
inline void prefetch_key(const KV* p, int64_t D) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < D * int64_t(sizeof(KV)); b += 64) {
    if constexpr (TO_L1)
      _mm_prefetch(c + b, _MM_HINT_T0);
    else
      _mm_prefetch(c + b, _MM_HINT_T1);
  }
}

// q . k as 16 lanes of partial sums, before vsum: a product, then FMAs along D
inline V dot_terms(const float* q, const float* k, int64_t DV) {
  V a = vmul(vload(q), vload(k));
  for (int64_t c = 1; c < DV; ++c) a = vfmadd(vload(q + 16 * c), vload(k + 16 * c), a);
  return a;
}

// The scores of one query against a whole block of KEY_BLOCK keys (rows of D in kb) into
// out[0..16). AVX512 sums the 16 keys' lanes together (sum16) where vsum would take one
// key at a time; the same additions either way, so the same bits.
#if defined(__AVX512F__)
// DV and D as constants where the caller knows them: every key's row is then a fixed
// offset from kb, one base register for all 16, where a run-time D kept 16 row pointers
// on the stack and reloaded one for every FMA (the 1.5B's attention at 300 keys, paired in
// one process: 0.94-0.96x the time at 1, 4 and 7 rows, the same bits)
template <int64_t DV_C = 0>
inline void block_scores_zmm(const float* q, const float* kb, int64_t DV, int64_t D, float* out) {
  if constexpr (DV_C > 0) DV = DV_C, D = 16 * DV_C;
  V a[16];
  const V q0 = vload(q);
  for (int t = 0; t < 16; ++t) a[t] = vmul(q0, vload(kb + t * D));
  for (int64_t c = 1; c < DV; ++c) {
    const V qc = vload(q + 16 * c);
    for (int t = 0; t < 16; ++t) a[t] = vfmadd(qc, vload(kb + t * D + 16 * c), a[t]);
  }
  vstore(out, sum16(a));
}
#endif

inline void block_scores(const float* q, const float* kb, int64_t DV, int64_t D, float* out) {
#if defined(__AVX512F__)
  switch (DV) {
    case 8: return block_scores_zmm<8>(q, kb, DV, D, out);
    case 4: return block_scores_zmm<4>(q, kb, DV, D, out);
    default: return block_scores_zmm(q, kb, DV, D, out);
  }
#else
  for (int t = 0; t < 16; ++t) out[t] = vsum(dot_terms(q, kb + t * D, DV));
#endif
}

// One (row, head)'s N accumulator vectors at `a` += p[t] * value row seen[t] of the block
// `vb` (fp32, rows of D), for t = 0 .. cnt in order: per lane the same FMAs in the same
// order as one key at a time, with the accumulators in registers across the block
// instead of a load and a store of each per key (which bounded a verification's rows).
template <int N>
inline void add_weighted(float* a, const float* p, const float* vb, const int8_t* seen, int64_t cnt,
                         int64_t D) {
  V ac[N];
  for (int i = 0; i < N; ++i) ac[i] = vload(a + 16 * i);
  for (int64_t t = 0; t < cnt; ++t) {
    const V w = vset(p[t]);
    const float* row = vb + seen[t] * D;
    for (int i = 0; i < N; ++i) ac[i] = vfmadd(w, vload(row + 16 * i), ac[i]);
  }
  for (int i = 0; i < N; ++i) vstore(a + 16 * i, ac[i]);
}
inline void add_weighted(int64_t n, float* a, const float* p, const float* vb, const int8_t* seen,
                         int64_t cnt, int64_t D) {
  switch (n) {
    case 8: return add_weighted<8>(a, p, vb, seen, cnt, D);
    case 7: return add_weighted<7>(a, p, vb, seen, cnt, D);
    case 6: return add_weighted<6>(a, p, vb, seen, cnt, D);
    case 5: return add_weighted<5>(a, p, vb, seen, cnt, D);
    case 4: return add_weighted<4>(a, p, vb, seen, cnt, D);
    case 3: return add_weighted<3>(a, p, vb, seen, cnt, D);
    case 2: return add_weighted<2>(a, p, vb, seen, cnt, D);
    default: return add_weighted<1>(a, p, vb, seen, cnt, D);
  }
}

// One (sequence, kv head): all its rows and the group's query heads. Queries and output
// are T, the pools KV (T itself, or a 16-bit cache under fp32 activations: widened to
// fp32 as they are loaded, so every product and sum is fp32 either way).
template <typename T, typename KV>
void attend(const T* q, const KV* kp, const KV* vp, T* out, const int64_t* table, int64_t bs,
            int64_t r0, int64_t r1, const int64_t* limit, const uint64_t* tree, int64_t g,
            int64_t H, int64_t Hkv, int64_t D, float scale) {
  const int64_t group = H / Hkv, rows = r1 - r0, nq = rows * group, DV = D / 16;
  int64_t end = 0;
  for (int64_t r = r0; r < r1; ++r) end = std::max(end, reach(limit[r], tree[r]));
  const int64_t width = end + 16;  // room for a full vector past the last score
  std::vector<float> s(nq * width), acc(nq * D, 0.f), qf(nq * D);
  std::vector<int64_t> n(rows, 0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < group; ++h)
      for (int64_t c = 0; c < DV; ++c) {
        const V v = load16(q + ((r0 + r) * H + g * group + h) * D + 16 * c);
        vstore(&qf[(r * group + h) * D + 16 * c], vmul(v, vset(scale)));
      }
  auto key_at = [&](const KV* pool, int64_t j) {
    return pool + ((table[j / bs] * bs + j % bs) * Hkv + g) * D;
  };
  // Keys go in blocks of KEY_BLOCK, each widened to fp32 once (kb, vb) for all the rows
  // and heads; seen[] lists the block's keys that row r sees, in order
  std::vector<float> kb(KEY_BLOCK * D), vb(KEY_BLOCK * D);
  int8_t seen[KEY_BLOCK];
  const auto keys_seen = [&](int64_t r, int64_t j0, int64_t j1) {
    int64_t cnt = 0;
    for (int64_t j = j0; j < j1; ++j)
      if (sees(j, limit[r0 + r], tree[r0 + r])) seen[cnt++] = int8_t(j - j0);
    return cnt;
  };
  const auto widen = [&](std::vector<float>& to, const KV* pool, int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      const KV* row = key_at(pool, j);
      for (int64_t c = 0; c < DV; ++c) vstore(&to[(j - j0) * D + 16 * c], load16(row + 16 * c));
    }
  };
  // scores, packed per (row, head) in the order of the keys the row sees; the values of
  // the keys ahead go to L2 for the pass after
  for (int64_t j0 = 0; j0 < end; j0 += KEY_BLOCK) {
    const int64_t j1 = std::min(end, j0 + KEY_BLOCK);
    for (int64_t j = j0 + AHEAD; j < std::min(end, j1 + AHEAD); ++j) {
      prefetch_key<true>(key_at(kp, j), D);
      prefetch_key<false>(key_at(vp, j), D);
    }
    widen(kb, kp, j0, j1);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t cnt = keys_seen(r, j0, j1);
      for (int64_t h = 0; h < group; ++h) {
        const float* qv = &qf[(r * group + h) * D];
        float* out_s = &s[(r * group + h) * width + n[r]];
        if (cnt == KEY_BLOCK) {
          block_scores(qv, kb.data(), DV, D, out_s);
          continue;
        }
        for (int64_t t = 0; t < cnt; ++t) out_s[t] = vsum(dot_terms(qv, &kb[seen[t] * D], DV));
      }
      n[r] += cnt;
    }
  }
  // softmax weights in place; 1 / sum kept per (row, head)
  std::vector<float> inv(nq);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < group; ++h) {
      float* sv = &s[(r * group + h) * width];
      const int64_t m = n[r];
      // the last vector's lanes past m read scores of no key (the row has room for them):
      // -inf for the max, 0 after exp, and storing them there changes no score
      V mx = vset(-INFINITY);
      for (int64_t i = 0; i < m; i += 16) mx = vmax(mx, vhead(sv + i, m - i, -INFINITY));
      const V top = vset(vtop(mx));
      V sum = vzero();
      for (int64_t i = 0; i < m; i += 16) {
        const V p = vkeep(exp_nonpositive(vsub(vhead(sv + i, m - i, 0.f), top)), m - i);
        vstore(sv + i, p);
        sum = vadd(sum, p);
      }
      inv[r * group + h] = 1.f / vsum(sum);
    }
  // weighted values, keys again in increasing order: each (row, head) adds the keys of a
  // block it sees into accumulators held in registers (add_weighted)
  std::fill(n.begin(), n.end(), 0);
  for (int64_t j0 = 0; j0 < end; j0 += KEY_BLOCK) {
    const int64_t j1 = std::min(end, j0 + KEY_BLOCK);
    for (int64_t j = j0 + AHEAD; j < std::min(end, j1 + AHEAD); ++j) prefetch_key<true>(key_at(vp, j), D);
    widen(vb, vp, j0, j1);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t cnt = keys_seen(r, j0, j1);
      if (cnt == 0) continue;
      for (int64_t h = 0; h < group; ++h) {
        const float* p = &s[(r * group + h) * width + n[r]];
        float* a = &acc[(r * group + h) * D];
        for (int64_t c0 = 0; c0 < DV; c0 += WIDE_ACC)  // as many vectors as registers hold
          add_weighted(std::min<int64_t>(WIDE_ACC, DV - c0), a + 16 * c0, p, vb.data() + 16 * c0,
                       seen, cnt, D);
      }
      n[r] += cnt;
    }
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < group; ++h) {
      const V w = vset(inv[r * group + h]);
      T* o = out + ((r0 + r) * H + g * group + h) * D;
      for (int64_t c = 0; c < DV; ++c) store16(o + 16 * c, vmul(vload(&acc[(r * group + h) * D + 16 * c]), w));
    }
}

}  // namespace

// q [T, H, D] (bf16 or fp32, D a multiple of 16, at most 256); pools [slots, Hkv, D] of
// q's dtype, or fp16 / bf16 under fp32 q; table int64 [B, blocks]; seq_rows int64 [B + 1]
// (sequence b owns rows seq_rows[b] .. seq_rows[b+1]); limit int64 [T]; tree int64 [T]
// (bits, see above). Returns [T, H, D].
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                           const at::Tensor& table, int64_t block_size, const at::Tensor& seq_rows,
                           const at::Tensor& limit, const at::Tensor& tree, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be a contiguous [T, H, D] tensor");
  TORCH_CHECK(k_pool.dim() == 3 && k_pool.is_contiguous() && v_pool.is_contiguous(),
              "pools must be contiguous [slots, Hkv, D]");
  check_kv_dtypes(q.scalar_type(), k_pool, v_pool);
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), Hkv = k_pool.size(1);
  TORCH_CHECK(D % 16 == 0 && D <= 256 && k_pool.size(2) == D, "head_dim must be 16..256, x16");
  TORCH_CHECK(H % Hkv == 0, "query heads must be a multiple of kv heads");
  const int64_t B = table.size(0);
  TORCH_CHECK(seq_rows.numel() == B + 1 && limit.numel() == T && tree.numel() == T,
              "index sizes do not match");
  auto out = at::empty_like(q);
  const auto* tb = table.data_ptr<int64_t>();
  const auto* sr = seq_rows.data_ptr<int64_t>();
  const auto* lim = limit.data_ptr<int64_t>();
  const auto* tr = reinterpret_cast<const uint64_t*>(tree.data_ptr<int64_t>());
  const int64_t cols = table.size(1);
  with_kv_dtypes(q.scalar_type(), k_pool.scalar_type(), [&](auto q_type, auto kv_type) {
    using T = decltype(q_type);
    using KV = decltype(kv_type);
    // one task per (sequence, kv head, tile of its rows), a head's tiles in a row (the
    // threads split the list in equal runs, as they split whole heads); each owns its output
    struct Task {
      int64_t b, g, r0, r1;
    };
    std::vector<Task> tasks;
    for (int64_t b = 0; b < B; ++b) {
      int64_t end = 0;
      for (int64_t r = sr[b]; r < sr[b + 1]; ++r) end = std::max(end, reach(lim[r], tr[r]));
      const int64_t per = tile_rows(H / Hkv, end);
      for (int64_t g = 0; g < Hkv; ++g)
        for (int64_t r0 = sr[b]; r0 < sr[b + 1]; r0 += per)
          tasks.push_back({b, g, r0, std::min(r0 + per, sr[b + 1])});
    }
    at::parallel_for(0, int64_t(tasks.size()), 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const Task& k = tasks[t];
        attend(q.data_ptr<T>(), k_pool.data_ptr<KV>(), v_pool.data_ptr<KV>(), out.data_ptr<T>(),
               tb + k.b * cols, block_size, k.r0, k.r1, lim, tr, k.g, H, Hkv, D, float(scale));
      }
    });
  });
  return out;
}
