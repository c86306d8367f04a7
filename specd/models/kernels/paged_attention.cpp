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
// thread runs it. Dots and sums are fp32 with AVX512; exp is a degree-6 polynomial.

// Built only with AVX512 (specd/models/native.py); an AVX2 build leaves it out.
#if defined(__AVX512F__)

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// exp(x) for x <= 0: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by its Taylor polynomial to r^6
// (relative error < 2e-7 there), times 2^n.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);  // ln2, high bits
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);       // ln2, the rest
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

template <typename T>
inline __m512 load16(const T* p);
template <>
inline __m512 load16<float>(const float* p) { return _mm512_loadu_ps(p); }
template <>
inline __m512 load16<at::BFloat16>(const at::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

template <typename T>
inline void store16(T* p, __m512 v);
template <>
inline void store16<float>(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
template <>
inline void store16<at::BFloat16>(at::BFloat16* p, __m512 v) {
  // round to nearest even, as torch's .to(bfloat16) for finite values
  __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
}

inline bool sees(int64_t j, int64_t limit, uint64_t tree) {
  if (j < limit) return true;
  const int64_t i = j - limit;
  return i < 64 && ((tree >> i) & 1u);
}

inline int64_t reach(int64_t limit, uint64_t tree) {  // one past the last key seen
  return tree ? limit + 64 - __builtin_clzll(tree) : limit;
}

// One (sequence, kv head): all its rows and the group's query heads.
template <typename T>
void attend(const T* q, const T* kp, const T* vp, T* out, const int64_t* table, int64_t bs,
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
        const __m512 v = load16(q + ((r0 + r) * H + g * group + h) * D + 16 * c);
        _mm512_storeu_ps(&qf[(r * group + h) * D + 16 * c], _mm512_mul_ps(v, _mm512_set1_ps(scale)));
      }
  auto key_at = [&](const T* pool, int64_t j) {
    return pool + ((table[j / bs] * bs + j % bs) * Hkv + g) * D;
  };
  // scores, packed per (row, head) in the order of the keys the row sees
  for (int64_t j = 0; j < end; ++j) {
    const T* k = key_at(kp, j);
    __m512 kv[16];
    for (int64_t c = 0; c < DV; ++c) kv[c] = load16(k + 16 * c);
    for (int64_t r = 0; r < rows; ++r) {
      if (!sees(j, limit[r0 + r], tree[r0 + r])) continue;
      for (int64_t h = 0; h < group; ++h) {
        const float* qv = &qf[(r * group + h) * D];
        __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qv), kv[0]);
        for (int64_t c = 1; c < DV; ++c) a = _mm512_fmadd_ps(_mm512_loadu_ps(qv + 16 * c), kv[c], a);
        s[(r * group + h) * width + n[r]] = _mm512_reduce_add_ps(a);
      }
      ++n[r];
    }
  }
  // softmax weights in place; 1 / sum kept per (row, head)
  std::vector<float> inv(nq);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < group; ++h) {
      float* sv = &s[(r * group + h) * width];
      const int64_t m = n[r];
      __m512 mx = _mm512_set1_ps(-INFINITY);
      for (int64_t i = 0; i < m; i += 16) {
        const __mmask16 live = m - i >= 16 ? 0xFFFF : __mmask16((1u << (m - i)) - 1);
        mx = _mm512_mask_max_ps(mx, live, mx, _mm512_maskz_loadu_ps(live, sv + i));
      }
      const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
      __m512 sum = _mm512_setzero_ps();
      for (int64_t i = 0; i < m; i += 16) {
        const __mmask16 live = m - i >= 16 ? 0xFFFF : __mmask16((1u << (m - i)) - 1);
        const __m512 p = _mm512_maskz_mov_ps(
            live, exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, sv + i), top)));
        _mm512_mask_storeu_ps(sv + i, live, p);
        sum = _mm512_add_ps(sum, p);
      }
      inv[r * group + h] = 1.f / _mm512_reduce_add_ps(sum);
    }
  // weighted values, keys again in increasing order
  std::fill(n.begin(), n.end(), 0);
  for (int64_t j = 0; j < end; ++j) {
    const T* v = key_at(vp, j);
    __m512 vv[16];
    for (int64_t c = 0; c < DV; ++c) vv[c] = load16(v + 16 * c);
    for (int64_t r = 0; r < rows; ++r) {
      if (!sees(j, limit[r0 + r], tree[r0 + r])) continue;
      for (int64_t h = 0; h < group; ++h) {
        const __m512 p = _mm512_set1_ps(s[(r * group + h) * width + n[r]]);
        float* a = &acc[(r * group + h) * D];
        for (int64_t c = 0; c < DV; ++c)
          _mm512_storeu_ps(a + 16 * c, _mm512_fmadd_ps(p, vv[c], _mm512_loadu_ps(a + 16 * c)));
      }
      ++n[r];
    }
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < group; ++h) {
      const __m512 w = _mm512_set1_ps(inv[r * group + h]);
      T* o = out + ((r0 + r) * H + g * group + h) * D;
      for (int64_t c = 0; c < DV; ++c)
        store16(o + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(&acc[(r * group + h) * D + 16 * c]), w));
    }
}

}  // namespace

// q [T, H, D] (bf16 or fp32, D a multiple of 16, at most 256); pools [slots, Hkv, D] of
// q's dtype; table int64 [B, blocks]; seq_rows int64 [B + 1] (sequence b owns rows
// seq_rows[b] .. seq_rows[b+1]); limit int64 [T]; tree int64 [T] (bits, see above).
// Returns [T, H, D].
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                           const at::Tensor& table, int64_t block_size, const at::Tensor& seq_rows,
                           const at::Tensor& limit, const at::Tensor& tree, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be a contiguous [T, H, D] tensor");
  TORCH_CHECK(k_pool.dim() == 3 && k_pool.is_contiguous() && v_pool.is_contiguous(),
              "pools must be contiguous [slots, Hkv, D]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat,
              "q must be bf16 or fp32");
  TORCH_CHECK(k_pool.scalar_type() == q.scalar_type() && v_pool.scalar_type() == q.scalar_type(),
              "q and the pools must have one dtype");
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
  // one task per (sequence, kv head); each owns its output rows
  at::parallel_for(0, B * Hkv, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / Hkv, g = t % Hkv;
      if (q.scalar_type() == at::kBFloat16)
        attend(q.data_ptr<at::BFloat16>(), k_pool.data_ptr<at::BFloat16>(),
               v_pool.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), tb + b * cols,
               block_size, sr[b], sr[b + 1], lim, tr, g, H, Hkv, D, float(scale));
      else
        attend(q.data_ptr<float>(), k_pool.data_ptr<float>(), v_pool.data_ptr<float>(),
               out.data_ptr<float>(), tb + b * cols, block_size, sr[b], sr[b + 1], lim, tr, g,
               H, Hkv, D, float(scale));
    }
  });
  return out;
}

#endif  // __AVX512F__
