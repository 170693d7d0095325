// Decode attention's AVX2 + FMA row kernel (attend_heads_avx2), for builds without AVX-512.
//
// A fragment of hearth's one kernel build: included by decode_attention.h after its generic
// loops (load_kv, softmax_scores, attend_generic), whose helpers it shares.

#if !defined(__AVX512F__) && defined(__AVX2__)
// ---------------------------------------------------------------------------------------------
// AVX2 + FMA (CPUs without AVX-512: AMD EPYC before Zen 4, older Xeons). The generic loops
// widen a token's K row once per query head and reduce every dot product on its own; here each
// 64-token chunk of a KV head's rows is widened once into float32 (L1), the dot products of 8
// tokens x one query row run as 8 FMA chains with the query's 64-value slice in registers and
// are reduced together (hsum8_avx2), and each V row is added into a query row's output held in
// 8 registers. Rows of any D % 64 == 0 (64, 128) and more than one KV head: MLA's latent (one
// KV head) stays on the generic loops, whose result its fused and module paths are tested to
// share within 1e-5 (with this kernel in both they differed by 6e-5 on a tiny V2 -- each call
// within 1.3e-6 of a float64 reference; not understood, so not taken). Forced on the 2-core EPYC
// (op alone, 30 layers of 9 x 64 heads, scattered tables, 2 threads), HEAD -> prefetch -> this:
// bf16 4k 33 -> 14 -> 11 ms, int8 21 -> 16 -> 7.3; 32k bf16 237 -> 96 -> 84, int8 161 -> 124 -> 60.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 load8(const e4m3* p) {  // the value / 256 (row_scale has the 256), as load16's
  const __m128i b = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(b, 7), _mm_set1_epi16(static_cast<int16_t>(0xBFFF))));
}

// Lanes 0..7: the sums of the 8 lanes of a[0..7].
inline __m256 hsum8_avx2(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // halves: 4 + 4 lanes' sums
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// rows[i * D ..] = token c0 + i's row of KV head g, widened (i < m; rows m .. m8 zero), and
// sc[i] its row scale times `mul` (0 for the padding).
template <typename KV>
inline void widen_rows_avx2(const KV* cache, const int64_t* off, int64_t c0, int64_t m, int64_t m8,
                            int64_t g, int64_t D, float mul, float* rows, float* sc) {
  const int64_t rs = row_stride<KV>(D);
  for (int64_t i = 0; i < m; ++i) {
    const KV* r = cache + off[c0 + i] + g * rs;
    for (int64_t j = 0; j < D; j += 8) _mm256_storeu_ps(rows + i * D + j, load8(r + j));
    sc[i] = mul * row_scale(r, D);
  }
  for (int64_t i = m; i < m8; ++i) {
    for (int64_t j = 0; j < D; j += 8) _mm256_storeu_ps(rows + i * D + j, _mm256_setzero_ps());
    sc[i] = 0.0f;
  }
}

// attend_heads_avx512's contract (every KV head of one work item; qgs[g]: R query rows of kv
// head g, parts[g] their partial results, scores [KVH][R][n]) for D % 64 == 0.
template <typename KV>
void attend_heads_avx2(const float* const* qgs, const KV* kc, const KV* vc, const int64_t* off,
                       int64_t t0, int64_t t1, int64_t R, int64_t KVH, int64_t D, float scale,
                       const int64_t* lim, float* const* parts, float* scores) {
  constexpr int64_t kChunk = 64;
  const int64_t n = t1 - t0, pstride = D + 2, record = KVH * row_stride<KV>(D) * int64_t{sizeof(KV)};
  const int64_t* o = off - t0;  // o[t]: token t's record
  thread_local std::vector<float> rows;
  rows.resize(kChunk * D);
  alignas(32) float sc[kChunk];
  prefetch_records(kc, o, t0, std::min(t1, t0 + kChunk), sizeof(KV), record);
  for (int64_t c0 = t0; c0 < t1; c0 += kChunk) {
    const int64_t m = std::min(kChunk, t1 - c0), m8 = (m + 7) / 8 * 8;
    prefetch_records(kc, o, c0 + m, std::min(t1, c0 + m + kChunk), sizeof(KV), record);
    for (int64_t g = 0; g < KVH; ++g) {
      widen_rows_avx2(kc, o, c0, m, m8, g, D, scale, rows.data(), sc);
      for (int64_t h = 0; h < R; ++h) {
        const float* qh = qgs[g] + h * D;
        float* dst = scores + (g * R + h) * n + (c0 - t0);
        for (int64_t i0 = 0; i0 < m8; i0 += 8) {
          __m256 acc[8];
          for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
          for (int64_t s = 0; s < D; s += 64) {
            __m256 qv[8];
            for (int c = 0; c < 8; ++c) qv[c] = _mm256_loadu_ps(qh + s + 8 * c);
            const float* kr = rows.data() + i0 * D + s;
            for (int c = 0; c < 8; ++c)
              for (int i = 0; i < 8; ++i)
                acc[i] = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(kr + i * D + 8 * c), acc[i]);
          }
          alignas(32) float out[8];
          _mm256_store_ps(out, _mm256_mul_ps(hsum8_avx2(acc), _mm256_load_ps(sc + i0)));
          for (int64_t i = 0; i < std::min<int64_t>(8, m - i0); ++i) dst[i0 + i] = out[i];
        }
      }
    }
  }
  for (int64_t g = 0; g < KVH; ++g) {
    softmax_scores(scores + g * R * n, n, R, lim, parts[g], pstride);
    for (int64_t h = 0; h < R; ++h)
      for (int64_t j = 0; j < D; ++j) parts[g][h * pstride + 2 + j] = 0.0f;
  }
  prefetch_records(vc, o, t0, std::min(t1, t0 + kChunk), sizeof(KV), record);
  for (int64_t c0 = t0; c0 < t1; c0 += kChunk) {
    const int64_t m = std::min(kChunk, t1 - c0);
    prefetch_records(vc, o, c0 + m, std::min(t1, c0 + m + kChunk), sizeof(KV), record);
    for (int64_t g = 0; g < KVH; ++g) {
      widen_rows_avx2(vc, o, c0, m, m, g, D, 1.0f, rows.data(), sc);
      for (int64_t h = 0; h < R; ++h) {
        const float* p = scores + (g * R + h) * n + (c0 - t0);
        alignas(32) float w[kChunk];
        for (int64_t i = 0; i < m; ++i) w[i] = p[i] * sc[i];
        for (int64_t s = 0; s < D; s += 64) {
          float* dst = parts[g] + h * pstride + 2 + s;
          __m256 acc[8];
          for (int c = 0; c < 8; ++c) acc[c] = _mm256_loadu_ps(dst + 8 * c);
          for (int64_t i = 0; i < m; ++i) {
            const __m256 wi = _mm256_set1_ps(w[i]);
            const float* vr = rows.data() + i * D + s;
            for (int c = 0; c < 8; ++c) acc[c] = _mm256_fmadd_ps(wi, _mm256_loadu_ps(vr + 8 * c), acc[c]);
          }
          for (int c = 0; c < 8; ++c) _mm256_storeu_ps(dst + 8 * c, acc[c]);
        }
      }
    }
  }
}
#endif
