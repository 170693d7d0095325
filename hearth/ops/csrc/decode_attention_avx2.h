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
// bf16 rows without the widened copy (attend_heads_avx2's contract): 16 values per 32-byte load
// widen by vpunpck{l,h}wd with zero (1 instruction per 8), which leaves them in the order
// 0-3 8-11 | 4-7 12-15 (kBf16Order); the queries are permuted the same way once per item, so
// the dot products are unchanged, and the output rows, accumulated in that order, are put
// back at the end. The K pass holds 4 tokens x up to 3 query rows of FMA chains (12
// registers), each K row widened once for all of them; the V pass adds each widened V row (16
// values at a time: 3 rows x 2 registers) into up to 3 query rows held in registers over all
// of the item's tokens; the softmax's exp runs 8 lanes at a time (fast_exp8). Op alone, 2
// threads, 9 x 64 heads over 3 KV heads, scattered tables, per layer: 8 x 2k tokens 1.99 ->
// 1.37 ms, 32 x 1k 3.98 -> 2.76 (the widened-copy kernel above, which int8 and fp8 keep).
constexpr int kBf16Order[16] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};
inline void widen16_bf16(const uint16_t* p, __m256& a, __m256& b) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), z = _mm256_setzero_si256();
  a = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, v));
  b = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, v));
}

// Lanes 0..3: the sums of a[0..3]'s 8 lanes.
inline __m128 hsum4_avx2(const __m256* a) {
  const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  return _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
}

// Scores of HB query rows (qp: permuted, stride D) against tokens [c0, c1) of one KV head (its
// rows at k + o[t]), times `scale`, into dst[h * n + t - c0]. With `fetch` (the first pass over
// an item's tokens) the records kAhead tokens on are read into L2 a few at a time, V's beside
// K's (an item, 512 tokens of 3 x 64 heads, is 2 x 196 KB: the other heads' passes and the V
// pass find it in L2; whole 64-token chunks at a time measured slower, 1.36 -> 1.53 ms).
template <int HB>
void bf16_scores(const float* qp, int64_t D, const uint16_t* k, const uint16_t* v,
                 const int64_t* o, int64_t c0, int64_t c1, float scale, float* dst, int64_t n,
                 int64_t record, bool fetch) {
  constexpr int64_t kAhead = 16;
  const __m128 sv = _mm_set1_ps(scale);
  int64_t t = c0;
  for (; t + 4 <= c1; t += 4) {
    if (fetch && t + kAhead + 4 <= c1) {
      prefetch_records(k, o, t + kAhead, t + kAhead + 4, 2, record);
      prefetch_records(v, o, t + kAhead, t + kAhead + 4, 2, record);
    }
    __m256 acc[HB][4];
    for (int h = 0; h < HB; ++h)
      for (int i = 0; i < 4; ++i) acc[h][i] = _mm256_setzero_ps();
    for (int64_t j = 0; j < D; j += 16)
      for (int i = 0; i < 4; ++i) {
        __m256 a, b;
        widen16_bf16(k + o[t + i] + j, a, b);
        for (int h = 0; h < HB; ++h) {
          acc[h][i] = _mm256_fmadd_ps(_mm256_loadu_ps(qp + h * D + j), a, acc[h][i]);
          acc[h][i] = _mm256_fmadd_ps(_mm256_loadu_ps(qp + h * D + j + 8), b, acc[h][i]);
        }
      }
    for (int h = 0; h < HB; ++h) _mm_storeu_ps(dst + h * n + (t - c0), _mm_mul_ps(hsum4_avx2(acc[h]), sv));
  }
  for (; t < c1; ++t)
    for (int h = 0; h < HB; ++h) {
      __m256 acc = _mm256_setzero_ps();
      for (int64_t j = 0; j < D; j += 16) {
        __m256 a, b;
        widen16_bf16(k + o[t] + j, a, b);
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(qp + h * D + j), a, acc);
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(qp + h * D + j + 8), b, acc);
      }
      dst[h * n + (t - c0)] = reduce_add8(acc) * scale;
    }
}

// out[h][j0 .. j0 + 16) (permuted order, stride D) += sum over tokens [c0, c1) of
// p[h * n + t - c0] * V row t, for HB query rows (HB x 2 accumulators, the widened row and a
// weight: no register spills at HB = 3).
template <int HB>
void bf16_values(const float* p, int64_t n, const uint16_t* v, const int64_t* o, int64_t c0,
                 int64_t c1, int64_t j0, float* out, int64_t D) {
  __m256 acc[HB][2];
  for (int h = 0; h < HB; ++h) {
    acc[h][0] = _mm256_loadu_ps(out + h * D + j0);
    acc[h][1] = _mm256_loadu_ps(out + h * D + j0 + 8);
  }
  for (int64_t t = c0; t < c1; ++t) {
    __m256 x0, x1;
    widen16_bf16(v + o[t] + j0, x0, x1);
    for (int h = 0; h < HB; ++h) {
      const __m256 w = _mm256_broadcast_ss(p + h * n + (t - c0));
      acc[h][0] = _mm256_fmadd_ps(w, x0, acc[h][0]);
      acc[h][1] = _mm256_fmadd_ps(w, x1, acc[h][1]);
    }
  }
  for (int h = 0; h < HB; ++h) {
    _mm256_storeu_ps(out + h * D + j0, acc[h][0]);
    _mm256_storeu_ps(out + h * D + j0 + 8, acc[h][1]);
  }
}

inline void attend_heads_bf16_avx2(const float* const* qgs, const uint16_t* kc, const uint16_t* vc,
                                   const int64_t* off, int64_t t0, int64_t t1, int64_t R,
                                   int64_t KVH, int64_t D, float scale, const int64_t* lim,
                                   float* const* parts, float* scores) {
  const int64_t n = t1 - t0, pstride = D + 2, rs = row_stride<uint16_t>(D);
  const int64_t record = KVH * rs * 2;
  const int64_t* o = off - t0;
  thread_local std::vector<float> qp, acc;
  qp.resize(R * D);
  acc.resize(R * D);
  prefetch_records(kc, o, t0, std::min(t1, t0 + 16), 2, record);
  prefetch_records(vc, o, t0, std::min(t1, t0 + 16), 2, record);
  for (int64_t g = 0; g < KVH; ++g) {
    for (int64_t h = 0; h < R; ++h)
      for (int64_t j = 0; j < D; ++j) qp[h * D + j] = qgs[g][h * D + j / 16 * 16 + kBf16Order[j % 16]];
    for (int64_t h = 0; h < R;) {
      const int64_t hb = std::min<int64_t>(3, R - h);
      const bool fetch = g == 0 && h == 0;
      const float* q = qp.data() + h * D;
      float* dst = scores + (g * R + h) * n;
      const uint16_t *k = kc + g * rs, *v = vc + g * rs;
      if (hb == 3) bf16_scores<3>(q, D, k, v, o, t0, t1, scale, dst, n, record, fetch);
      else if (hb == 2) bf16_scores<2>(q, D, k, v, o, t0, t1, scale, dst, n, record, fetch);
      else bf16_scores<1>(q, D, k, v, o, t0, t1, scale, dst, n, record, fetch);
      h += hb;
    }
  }
  for (int64_t g = 0; g < KVH; ++g) {
    softmax_scores(scores + g * R * n, n, R, lim, parts[g], pstride);
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t h = 0; h < R;) {
      const int64_t hb = std::min<int64_t>(3, R - h);
      const float* p = scores + (g * R + h) * n;
      float* out = acc.data() + h * D;
      const uint16_t* v = vc + g * rs;
      for (int64_t j0 = 0; j0 < D; j0 += 16) {
        if (hb == 3) bf16_values<3>(p, n, v, o, t0, t1, j0, out, D);
        else if (hb == 2) bf16_values<2>(p, n, v, o, t0, t1, j0, out, D);
        else bf16_values<1>(p, n, v, o, t0, t1, j0, out, D);
      }
      h += hb;
    }
    for (int64_t h = 0; h < R; ++h)
      for (int64_t j = 0; j < D; ++j)
        parts[g][h * pstride + 2 + j / 16 * 16 + kBf16Order[j % 16]] = acc[h * D + j];
  }
}
#endif
