// Decode attention over the paged cache (short queries, split along the context).
//
// A fragment of hearth's one kernel build: included by cpu_kernels.cpp inside
// namespace hearth::(anonymous), after the headers listed before it there.

// ---------------------------------------------------------------------------------------------
// Decode attention over the paged cache.
//
//   work item = (request b, context split s); split s covers tokens [s*S, (s+1)*S) of request
//   b, every KV head g and, per head, the G = H / KVH query heads (times the request's new
//   tokens) that share it. Each item writes a partial (max, sum, unnormalized out) per query
//   row; a second pass merges the splits.

// f(t, slot) for tokens t in [t0, t1), slot = t's row in the cache (block table[t / bs] at
// offset t % bs), reading the table once per block: an integer division per token read had
// been a fifth of decode attention's time.
template <typename F>
inline void for_each_slot(const int32_t* table, int64_t block_size, int64_t t0, int64_t t1,
                          const F& f) {
  for (int64_t t = t0; t < t1;) {
    const int64_t blk = t / block_size, end = std::min(t1, (blk + 1) * block_size);
    const int64_t base = static_cast<int64_t>(table[blk]) * block_size - blk * block_size;
    for (; t < end; ++t) f(t, base + t);
  }
}

template <typename KV>
inline float load_kv(const KV* p, int64_t j);
template <>
inline float load_kv<float>(const float* p, int64_t j) { return p[j]; }
template <>
inline float load_kv<uint16_t>(const uint16_t* p, int64_t j) { return bf16_to_float(p[j]); }
template <>
inline float load_kv<int8_t>(const int8_t* p, int64_t j) { return p[j]; }
template <>  // the value / 256 (row_scale has the 256)
inline float load_kv<e4m3>(const e4m3* p, int64_t j) { return _cvtsh_ss(e4m3_half_bits(p[j].bits)); }

// max(-inf, p[0..n)): vector lanes, not one dependent scalar max per element.
inline float max_of(const float* p, int64_t n) {
  int64_t i = 0;
  float mx = -INFINITY;
#if defined(__AVX512F__)
  __m512 v = _mm512_set1_ps(-INFINITY);
  for (; i + 16 <= n; i += 16) v = _mm512_max_ps(v, _mm512_loadu_ps(p + i));
  mx = _mm512_reduce_max_ps(v);
#elif defined(__AVX2__)
  __m256 v = _mm256_set1_ps(-INFINITY);
  for (; i + 8 <= n; i += 8) v = _mm256_max_ps(v, _mm256_loadu_ps(p + i));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, v);
  for (int j = 0; j < 8; ++j) mx = std::max(mx, lanes[j]);
#endif
  for (; i < n; ++i) mx = std::max(mx, p[i]);
  return mx;
}

// Scores [R, n] -> exp(score - max) in place; part[r] gets (max, sum of exp) per query row.
// Row r sees only the first lim[r] tokens (causal among a request's new tokens): the rest of
// its scores become 0; a row that sees none gets (-inf, 0).
inline void softmax_scores(float* scores, int64_t n, int64_t R, const int64_t* lim, float* part,
                           int64_t pstride) {
  for (int64_t h = 0; h < R; ++h) {
    float* sc = scores + h * n;
    const int64_t m = std::max<int64_t>(0, std::min(n, lim[h]));
    float mx = max_of(sc, m);
    float sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < m; ++i) {
      sc[i] = fast_exp(sc[i] - mx);
      sum += sc[i];
    }
    for (int64_t i = m; i < n; ++i) sc[i] = 0;
    part[h * pstride] = mx;
    part[h * pstride + 1] = sum;
  }
}

// Read ahead into L2 the cache records (`bytes` each: every KV head's row of a token) of tokens
// [a, b) of a work item, off[t - t0] the records' element offsets (elem bytes each). The splits'
// blocks are scattered over the pool, so the hardware prefetchers see short runs; a software
// prefetch a few tokens ahead lets the DRAM reads overlap the dot products (2-core EPYC, 30
// layers of 9 x 64 heads over 32k tokens, 2 threads: scattered tables bf16 76 -> 49 ms, int8
// 62 -> 25; tables in pool order bf16 51 -> 38). MLA's wide rows (long runs the hardware
// follows) got slower with it (21 -> 27 ms at 16k) and take none.
inline void prefetch_records(const void* base, const int64_t* off, int64_t a, int64_t b,
                             int64_t elem, int64_t bytes) {
  const char* p = static_cast<const char*>(base);
  for (int64_t t = a; t < b; ++t)
    for (int64_t x = 0; x < bytes; x += 64) _mm_prefetch(p + off[t] * elem + x, _MM_HINT_T1);
}

// One work item: query heads [g*G, (g+1)*G) of request b over context tokens [t0, t1).
// Writes per head: part[h] = (max score, sum of exp, unnormalized output[D]).
template <typename KV>
void attend_generic(const float* qg, const KV* kc, const KV* vc, const int64_t* off, int64_t t0,
                    int64_t t1, int64_t G, int64_t KVH, int64_t g, int64_t D, int64_t Dv,
                    float scale, const int64_t* lim, float* part, float* scores) {
  const int64_t n = t1 - t0, pstride = D + 2, rs = row_stride<KV>(D);
  const int64_t row = rs * int64_t{sizeof(KV)};
  constexpr int64_t kAhead = 16;  // tokens read ahead (prefetch_records)
  prefetch_records(kc + g * rs, off - t0, t0, std::min(t1, t0 + kAhead), sizeof(KV), row);
  for (int64_t t = t0; t < t1; ++t) {
    if (t + kAhead < t1) prefetch_records(kc + g * rs, off - t0, t + kAhead, t + kAhead + 1, sizeof(KV), row);
    const KV* k = kc + off[t - t0] + g * rs;
    const float ks = scale * row_scale(k, D);
    for (int64_t h = 0; h < G; ++h) {
      const float* qh = qg + h * D;
      float dot = 0;
#pragma omp simd reduction(+ : dot)
      for (int64_t j = 0; j < D; ++j) dot += qh[j] * load_kv(k, j);
      scores[h * n + (t - t0)] = dot * ks;
    }
  }
  softmax_scores(scores, n, G, lim, part, pstride);
  for (int64_t h = 0; h < G; ++h)
    for (int64_t j = 0; j < Dv; ++j) part[h * pstride + 2 + j] = 0;
  prefetch_records(vc + g * rs, off - t0, t0, std::min(t1, t0 + kAhead), sizeof(KV), row);
  for (int64_t t = t0; t < t1; ++t) {
    if (t + kAhead < t1) prefetch_records(vc + g * rs, off - t0, t + kAhead, t + kAhead + 1, sizeof(KV), row);
    const KV* v = vc + off[t - t0] + g * rs;
    const float vs = row_scale(v, D);
    for (int64_t h = 0; h < G; ++h) {
      const float p = scores[h * n + (t - t0)] * vs;
      float* o = part + h * pstride + 2;
#pragma omp simd
      for (int64_t j = 0; j < Dv; ++j) o[j] += p * load_kv(v, j);
    }
  }
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline __m512 load16(const int8_t* p) {  // the int8 KV format's values, unscaled
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
// the fp8 KV format's values / 256, unscaled (e4m3_half_bits, 16 lanes at once): sign-extending
// the bytes to 16 bits and shifting left by 7 puts the sign at bit 15 and exponent + mantissa
// at bits 13..7; the mask clears the sign's copy left at bit 14.
inline __m512 load16(const e4m3* p) {
  const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(b, 7),
                                          _mm256_set1_epi16(static_cast<int16_t>(0xBFFF))));
}

// Lanes 0..7: the sums of the 16 lanes of v[0..7] (a transpose-and-add tree: ~3 instructions per
// vector instead of a horizontal reduction's ~8).
inline __m256 hsum8(const __m512* v) {
  __m512 x[4];
  for (int p = 0; p < 4; ++p)  // [a.L0 + a.L2, a.L1 + a.L3, b.L0 + b.L2, b.L1 + b.L3] (128-bit lanes)
    x[p] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  __m512 y[2];
  for (int p = 0; p < 2; ++p)  // lane L: vector 4p + L's four partial sums
    y[p] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * p], x[2 * p + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(x[2 * p], x[2 * p + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 u = _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 w = _mm512_add_ps(_mm512_shuffle_ps(u, u, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(u, u, _MM_SHUFFLE(3, 1, 3, 1)));
  // lane L holds [sum of v[L], sum of v[4 + L], ...]
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_castps512_ps256(_mm512_permutexvar_ps(order, w));
}

// One work item over every KV head at once, D = 16 * DV: the token loops are outermost, so a
// token's K (then V) rows of all heads -- adjacent in the cache -- are read together, and the
// cache streams in order while the scores and outputs are computed (one head at a time over the
// whole split read each token's record three times, strided). Rows of kv head g: qgs[g] (R query
// rows), partial results parts[g]; scores [KVH][R][n].
// Scores: 8 tokens at a time, HB rows per pass, the 8 x HB dot products left in registers and
// reduced together (hsum8). Outputs: per chunk of 64 tokens and head, each V row is loaded once
// for up to VB query rows, whose outputs stay in registers over the chunk (parts[g] between).
template <typename KV, int DV>
void attend_heads_avx512(const float* const* qgs, const KV* kc, const KV* vc, const int64_t* off,
                         int64_t t0, int64_t t1, int64_t R, int64_t KVH, float scale,
                         const int64_t* lim, float* const* parts, float* scores) {
  constexpr int64_t D = 16 * DV, RS = row_stride<KV>(D);
  constexpr int HB = DV <= 4 ? 3 : 2;  // HB * 8 accumulators + DV key registers fit in 32
  const int64_t n = t1 - t0, pstride = D + 2;
  const __m256 vscale = _mm256_set1_ps(scale);
  constexpr int64_t kAhead = 16;  // tokens of K read ahead
  const int64_t record = KVH * RS * int64_t{sizeof(KV)};
  prefetch_records(kc, off - t0, t0, std::min(t1, t0 + kAhead), sizeof(KV), record);
  int64_t t = t0;
  for (; t + 8 <= t1; t += 8) {
    prefetch_records(kc, off - t0, std::min(t1, t + kAhead), std::min(t1, t + kAhead + 8),
                     sizeof(KV), record);
    for (int64_t g = 0; g < KVH; ++g) {
      const KV* krow[8];
      for (int i = 0; i < 8; ++i) krow[i] = kc + off[t + i - t0] + g * RS;
      __m256 kscale = vscale;  // int8 / fp8 rows: each token's own scale on its score
      if constexpr (scaled_rows<KV>)
        kscale = _mm256_mul_ps(vscale, _mm256_setr_ps(
            row_scale(krow[0], D), row_scale(krow[1], D), row_scale(krow[2], D), row_scale(krow[3], D),
            row_scale(krow[4], D), row_scale(krow[5], D), row_scale(krow[6], D), row_scale(krow[7], D)));
      const float* qg = qgs[g];
      float* sg = scores + g * R * n;
      for (int64_t h0 = 0; h0 < R; h0 += HB) {
        const int64_t hn = std::min<int64_t>(HB, R - h0);
        __m512 acc[HB][8];
        for (int i = 0; i < 8; ++i) {
          __m512 kv[DV];
          for (int c = 0; c < DV; ++c) kv[c] = load16(krow[i] + 16 * c);
          for (int hh = 0; hh < HB; ++hh) {
            if (hh >= hn) break;
            const float* qh = qg + (h0 + hh) * D;
            __m512 a = _mm512_mul_ps(kv[0], _mm512_loadu_ps(qh));
            for (int c = 1; c < DV; ++c) a = _mm512_fmadd_ps(kv[c], _mm512_loadu_ps(qh + 16 * c), a);
            acc[hh][i] = a;
          }
        }
        for (int hh = 0; hh < hn; ++hh)
          _mm256_storeu_ps(sg + (h0 + hh) * n + (t - t0), _mm256_mul_ps(hsum8(acc[hh]), kscale));
      }
    }
  }
  for (; t < t1; ++t)
    for (int64_t g = 0; g < KVH; ++g) {
      const KV* k = kc + off[t - t0] + g * RS;
      const float ks = scale * row_scale(k, D);
      __m512 kv[DV];
      for (int c = 0; c < DV; ++c) kv[c] = load16(k + 16 * c);
      for (int64_t h = 0; h < R; ++h) {
        const float* qh = qgs[g] + h * D;
        __m512 acc = _mm512_mul_ps(kv[0], _mm512_loadu_ps(qh));
        for (int c = 1; c < DV; ++c) acc = _mm512_fmadd_ps(kv[c], _mm512_loadu_ps(qh + 16 * c), acc);
        scores[(g * R + h) * n + (t - t0)] = _mm512_reduce_add_ps(acc) * ks;
      }
    }
  constexpr int64_t kChunk = 64;  // 64 tokens of V, all heads: 48 KB (fp32)
  prefetch_records(vc, off - t0, t0, std::min(t1, t0 + kChunk), sizeof(KV), record);
  for (int64_t g = 0; g < KVH; ++g) {
    softmax_scores(scores + g * R * n, n, R, lim, parts[g], pstride);
    for (int64_t h = 0; h < R; ++h)
      for (int64_t j = 0; j < D; ++j) parts[g][h * pstride + 2 + j] = 0.0f;
  }
  constexpr int VB = DV <= 4 ? 6 : 3;  // VB * DV output registers + DV value registers fit in 32
  for (int64_t c0 = t0; c0 < t1; c0 += kChunk) {
    const int64_t c1 = std::min(t1, c0 + kChunk);
    prefetch_records(vc, off - t0, c1, std::min(t1, c1 + kChunk), sizeof(KV), record);  // the next chunk
    for (int64_t g = 0; g < KVH; ++g) {
      const float* sg = scores + g * R * n;
      float* part = parts[g];
      for (int64_t h0 = 0; h0 < R; h0 += VB) {
        const int64_t hn = std::min<int64_t>(VB, R - h0);
        __m512 o[VB][DV];
        for (int h = 0; h < VB; ++h) {
          if (h >= hn) break;
          for (int c = 0; c < DV; ++c) o[h][c] = _mm512_loadu_ps(part + (h0 + h) * pstride + 2 + 16 * c);
        }
        for (int64_t tt = c0; tt < c1; ++tt) {
          const KV* v = vc + off[tt - t0] + g * RS;
          const float vs = row_scale(v, D);
          __m512 vv[DV];
          for (int c = 0; c < DV; ++c) vv[c] = load16(v + 16 * c);
          for (int h = 0; h < VB; ++h) {
            if (h >= hn) break;
            const __m512 p = _mm512_set1_ps(sg[(h0 + h) * n + (tt - t0)] * vs);
            for (int c = 0; c < DV; ++c) o[h][c] = _mm512_fmadd_ps(p, vv[c], o[h][c]);
          }
        }
        for (int h = 0; h < hn; ++h)
          for (int c = 0; c < DV; ++c) _mm512_storeu_ps(part + (h0 + h) * pstride + 2 + 16 * c, o[h][c]);
      }
    }
  }
}

// AVX512-BF16 (Zen 4, Cooper Lake, Sapphire Rapids) for a bf16 latent cache: MLA's absorbed
// decode does 2 H multiply-adds per cached value, so on a CPU its long-context steps are bound
// by FMAs, not by the bytes. Scores and outputs are dot products of bf16 pairs (vdpbf16ps: 32
// multiply-adds per instruction, the cached rows used as stored instead of widened per query
// block), sums in float32; the query (once per work item) and the probabilities are rounded to
// bf16 (nearest even), which the cached values already are. On a 16-head, 320-wide latent at
// 16k tokens: 2.28 -> 1.34 ms per layer (2-core EPYC). Compiled for that ISA in every AVX-512
// build, called only where the CPU has it (`bf16_dot_products`).
#define HEARTH_TARGET_BF16 __attribute__((target("avx512bf16,avx512bw,avx512vl,avx512f")))

HEARTH_TARGET_BF16 inline __m512bh load_bh(const uint16_t* p) {
  return reinterpret_cast<__m512bh>(_mm512_loadu_si512(p));
}

// scores[h * n + t - t0] = scale * <q_h, k_t> for query rows h < R of qg ([R, D] float32, D a
// multiple of 32) and the tokens' bf16 rows at kc + off[t - t0].
HEARTH_TARGET_BF16 void wide_scores_bf16(const float* qg, const uint16_t* kc, const int64_t* off,
                                         int64_t t0, int64_t t1, int64_t R, int64_t D,
                                         float scale, float* scores) {
  thread_local std::vector<uint16_t> qb;
  qb.resize(R * D);
  for (int64_t i = 0; i < R * D; i += 32)
    _mm512_storeu_si512(qb.data() + i, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(
                                           _mm512_loadu_ps(qg + i + 16), _mm512_loadu_ps(qg + i))));
  constexpr int HB = 3;  // 3 * 8 accumulators + 3 query + 1 key registers fit in 32
  const int64_t n = t1 - t0, dc = D / 32;
  const __m256 vscale = _mm256_set1_ps(scale);
  const uint16_t* q = qb.data();
  int64_t t = t0;
  for (; t + 8 <= t1; t += 8) {
    const uint16_t* krow[8];
    for (int i = 0; i < 8; ++i) krow[i] = kc + off[t + i - t0];
    for (int64_t h0 = 0; h0 < R; h0 += HB) {
      const int64_t hn = std::min<int64_t>(HB, R - h0);
      __m512 acc[HB][8];
      for (int hh = 0; hh < HB; ++hh)
        for (int i = 0; i < 8; ++i) acc[hh][i] = _mm512_setzero_ps();
      for (int64_t c = 0; c < dc; ++c) {
        __m512bh qv[HB];
        for (int hh = 0; hh < HB; ++hh)
          qv[hh] = load_bh(q + std::min<int64_t>(h0 + hh, R - 1) * D + 32 * c);
        for (int i = 0; i < 8; ++i) {
          const __m512bh k = load_bh(krow[i] + 32 * c);
          for (int hh = 0; hh < HB; ++hh) acc[hh][i] = _mm512_dpbf16_ps(acc[hh][i], qv[hh], k);
        }
      }
      for (int hh = 0; hh < hn; ++hh)
        _mm256_storeu_ps(scores + (h0 + hh) * n + (t - t0), _mm256_mul_ps(hsum8(acc[hh]), vscale));
    }
  }
  for (; t < t1; ++t) {
    const uint16_t* k = kc + off[t - t0];
    for (int64_t h = 0; h < R; ++h) {
      __m512 a = _mm512_setzero_ps();
      for (int64_t c = 0; c < dc; ++c) a = _mm512_dpbf16_ps(a, load_bh(q + h * D + 32 * c), load_bh(k + 32 * c));
      scores[h * n + (t - t0)] = _mm512_reduce_add_ps(a) * scale;
    }
  }
}

// One work item over a single wide KV head (MLA's latent row: every query head attends to the
// same row, D = 16 * dv of any width, e.g. 320 or 576): R query rows against tokens [t0, t1).
// Scores: for 8 tokens x HB rows the d-chunks run innermost with the 8 x HB dot products in
// registers (the row's chunks stream from L1; no register file holds a 576-wide row), reduced
// together by hsum8. Outputs: 64 values of D at a time for up to VB rows, over every token.
// part[h * pstride + 2 + d] = sum_t p[h, t] v_t[d] for the tokens' bf16 rows at vc + off[t - t0]
// and p = scores [R, n] (float32, rounded to bf16 here): tokens in pairs, each pair's two rows
// interleaved (unpack) so one vdpbf16ps multiplies 16 values of both tokens by their pair of
// probabilities. The unpacks leave each 128-bit lane's 8 values as 4 + 4 (lo, hi): put back in
// order when the sums are stored.
HEARTH_TARGET_BF16 void wide_values_bf16(const float* scores, const uint16_t* vc,
                                         const int64_t* off, int64_t t0, int64_t t1, int64_t R,
                                         int64_t D, float* part, int64_t pstride) {
  const int64_t n = t1 - t0, np = (n + 1) / 2, dc = D / 32;
  thread_local std::vector<uint32_t> pairs;  // [R, np]: (bf16 p[t], bf16 p[t + 1]) per pair
  pairs.resize(R * np);
  for (int64_t h = 0; h < R; ++h)
    for (int64_t j = 0; j < np; ++j) {
      const float a = scores[h * n + 2 * j], b = 2 * j + 1 < n ? scores[h * n + 2 * j + 1] : 0.0f;
      pairs[h * np + j] = float_to_bf16(a) | (static_cast<uint32_t>(float_to_bf16(b)) << 16);
    }
  constexpr int VB = 6, VC = 2;  // 6 rows x 2 chunks of 32 values x (lo, hi) + 4 value registers
  alignas(64) float lo[16], hi[16];
  for (int64_t c0 = 0; c0 < dc; c0 += VC) {
    const int64_t cn = std::min<int64_t>(VC, dc - c0);
    for (int64_t h0 = 0; h0 < R; h0 += VB) {
      const int64_t hn = std::min<int64_t>(VB, R - h0);
      __m512 o[VB][VC][2];
      for (int h = 0; h < VB; ++h)
        for (int c = 0; c < VC; ++c) o[h][c][0] = o[h][c][1] = _mm512_setzero_ps();
      for (int64_t j = 0; j < np; ++j) {
        const uint16_t* va = vc + off[2 * j] + 32 * c0;
        const uint16_t* vb = 2 * j + 1 < n ? vc + off[2 * j + 1] + 32 * c0 : va;  // p = 0 there
        __m512bh vv[VC][2];
        for (int c = 0; c < VC; ++c) {
          const int64_t cc = c < cn ? c : 0;
          const __m512i a = _mm512_loadu_si512(va + 32 * cc), b = _mm512_loadu_si512(vb + 32 * cc);
          vv[c][0] = reinterpret_cast<__m512bh>(_mm512_unpacklo_epi16(a, b));
          vv[c][1] = reinterpret_cast<__m512bh>(_mm512_unpackhi_epi16(a, b));
        }
        for (int h = 0; h < VB; ++h) {
          if (h >= hn) break;
          const __m512bh p = reinterpret_cast<__m512bh>(
              _mm512_set1_epi32(static_cast<int>(pairs[(h0 + h) * np + j])));
          for (int c = 0; c < VC; ++c) {
            o[h][c][0] = _mm512_dpbf16_ps(o[h][c][0], p, vv[c][0]);
            o[h][c][1] = _mm512_dpbf16_ps(o[h][c][1], p, vv[c][1]);
          }
        }
      }
      for (int h = 0; h < hn; ++h)
        for (int c = 0; c < cn; ++c) {
          _mm512_store_ps(lo, o[h][c][0]);
          _mm512_store_ps(hi, o[h][c][1]);
          float* dst = part + (h0 + h) * pstride + 2 + 32 * (c0 + c);
          for (int k = 0; k < 4; ++k)  // 128-bit lane k: values 8k..8k+3 (lo), 8k+4..8k+7 (hi)
            for (int i = 0; i < 4; ++i) {
              dst[8 * k + i] = lo[4 * k + i];
              dst[8 * k + 4 + i] = hi[4 * k + i];
            }
        }
    }
  }
}

template <typename KV>
void attend_wide_avx512(const float* qg, const KV* kc, const KV* vc, const int64_t* off,
                        int64_t t0, int64_t t1, int64_t R, int64_t D, int64_t Dv, float scale,
                        const int64_t* lim, float* part, float* scores) {
  const int64_t n = t1 - t0, pstride = D + 2, dv = Dv / 16;
  if constexpr (std::is_same_v<KV, uint16_t>) {
    if (bf16_dot_products() && D % 32 == 0) {
      wide_scores_bf16(qg, kc, off, t0, t1, R, D, scale, scores);
      goto values;
    }
  }
  {
  constexpr int HB = 3;  // 3 * 8 accumulators + 3 query + 1 key registers fit in 32
  const __m256 vscale = _mm256_set1_ps(scale);
  int64_t t = t0;
  for (; t + 8 <= t1; t += 8) {
    const KV* krow[8];
    for (int i = 0; i < 8; ++i) krow[i] = kc + off[t + i - t0];
    for (int64_t h0 = 0; h0 < R; h0 += HB) {
      const int64_t hn = std::min<int64_t>(HB, R - h0);
      __m512 acc[HB][8];
      for (int hh = 0; hh < HB; ++hh)
        for (int i = 0; i < 8; ++i) acc[hh][i] = _mm512_setzero_ps();
      for (int64_t c = 0; c < dv; ++c) {
        __m512 qv[HB];
        for (int hh = 0; hh < HB; ++hh)
          qv[hh] = hh < hn ? _mm512_loadu_ps(qg + (h0 + hh) * D + 16 * c) : _mm512_setzero_ps();
        for (int i = 0; i < 8; ++i) {
          const __m512 k = load16(krow[i] + 16 * c);
          for (int hh = 0; hh < HB; ++hh) acc[hh][i] = _mm512_fmadd_ps(qv[hh], k, acc[hh][i]);
        }
      }
      for (int hh = 0; hh < hn; ++hh)
        _mm256_storeu_ps(scores + (h0 + hh) * n + (t - t0), _mm256_mul_ps(hsum8(acc[hh]), vscale));
    }
  }
  for (; t < t1; ++t) {
    const KV* k = kc + off[t - t0];
    for (int64_t h = 0; h < R; ++h) {
      __m512 a = _mm512_setzero_ps();
      for (int64_t c = 0; c < dv; ++c)
        a = _mm512_fmadd_ps(_mm512_loadu_ps(qg + h * D + 16 * c), load16(k + 16 * c), a);
      scores[h * n + (t - t0)] = _mm512_reduce_add_ps(a) * scale;
    }
  }
  }
values:
  softmax_scores(scores, n, R, lim, part, pstride);
  if constexpr (std::is_same_v<KV, uint16_t>) {
    if (bf16_dot_products() && Dv % 32 == 0) {
      wide_values_bf16(scores, vc, off, t0, t1, R, Dv, part, pstride);
      return;
    }
  }
  constexpr int VB = 6, VC = 4;  // 6 rows x 4 vectors of output + 4 value registers
  for (int64_t c0 = 0; c0 < dv; c0 += VC) {
    const int64_t cn = std::min<int64_t>(VC, dv - c0);
    for (int64_t h0 = 0; h0 < R; h0 += VB) {
      const int64_t hn = std::min<int64_t>(VB, R - h0);
      __m512 o[VB][VC];
      for (int h = 0; h < VB; ++h)
        for (int c = 0; c < VC; ++c) o[h][c] = _mm512_setzero_ps();
      for (int64_t tt = t0; tt < t1; ++tt) {
        const KV* v = vc + off[tt - t0] + 16 * c0;
        __m512 vv[VC];
        for (int c = 0; c < VC; ++c) vv[c] = c < cn ? load16(v + 16 * c) : _mm512_setzero_ps();
        for (int h = 0; h < VB; ++h) {
          if (h >= hn) break;
          const __m512 p = _mm512_set1_ps(scores[(h0 + h) * n + (tt - t0)]);
          for (int c = 0; c < VC; ++c) o[h][c] = _mm512_fmadd_ps(p, vv[c], o[h][c]);
        }
      }
      for (int h = 0; h < hn; ++h)
        for (int c = 0; c < cn; ++c)
          _mm512_storeu_ps(part + (h0 + h) * pstride + 2 + 16 * (c0 + c), o[h][c]);
    }
  }
}
#endif

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

// Merge the splits of query head h of request b into out[b, h].
inline void merge_splits(const float* base, int64_t num_splits, int64_t stride, int64_t D, float* o) {
  float mx = -INFINITY;
  for (int64_t s = 0; s < num_splits; ++s) mx = std::max(mx, base[s * stride]);
  for (int64_t j = 0; j < D; ++j) o[j] = 0;
  float denom = 0;
  for (int64_t s = 0; s < num_splits; ++s) {
    const float* p = base + s * stride;
    if (p[1] == 0) continue;
    const float w = fast_exp(p[0] - mx);
    denom += w * p[1];
#pragma omp simd
    for (int64_t j = 0; j < D; ++j) o[j] += w * p[2 + j];
  }
  const float inv = denom > 0 ? 1.0f / denom : 0.0f;
#pragma omp simd
  for (int64_t j = 0; j < D; ++j) o[j] *= inv;
}

// Request b has query_lens[b] new tokens (rows query_start[b]... of q), the last ones of its
// context: query j sits at position ctx - qlen + j and sees tokens [0, ctx - qlen + j].
// Work item = (request, context split) over every KV head and every query of the request.
template <typename KV>
void decode_attention_impl(const float* q, const KV* kc, const KV* vc, const int32_t* tables,
                           const int32_t* ctx, const int32_t* qlen, const int64_t* qstart,
                           int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t Dv,
                           int64_t block_size, int64_t max_blocks, float scale, int64_t split,
                           int64_t num_splits, int64_t max_q, float* partial, float* out,
                           int64_t threads) {
  const int64_t G = H / KVH, pstride = D + 2, RG = max_q * G;  // RG: rows per (item, kv head)
  auto part_at = [&](int64_t b, int64_t g, int64_t s) {
    return partial + ((b * KVH + g) * num_splits + s) * RG * pstride;
  };
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b) total += static_cast<int64_t>(ctx[b]) * qlen[b];
  // One task per (request, context split), covering every KV head: a token's K/V rows of all
  // heads are adjacent in the cache, so the heads read the split's bytes from DRAM once (one
  // task per head re-read each cache line per head: 9 GB/s instead of ~20 at 6k tokens).
  auto item_fn = [&](int64_t item) {
    thread_local std::vector<float> scores, qbuf;
    thread_local std::vector<int64_t> lim, offs;
    const int64_t b = item / num_splits, s = item % num_splits, ql = qlen[b];
    const int64_t t0 = s * split, t1 = std::min<int64_t>(ctx[b], t0 + split), R = ql * G;
    offs.resize(std::max<int64_t>(0, t1 - t0));  // each token's offset in the cache (all heads)
    for_each_slot(tables + b * max_blocks, block_size, t0, t1,
                  [&](int64_t t, int64_t slot) { offs[t - t0] = slot * KVH * row_stride<KV>(D); });
    lim.resize(R);
    for (int64_t j = 0; j < ql; ++j)
      for (int64_t h = 0; h < G; ++h) lim[j * G + h] = ctx[b] - ql + j + 1 - t0;
#if defined(__AVX512F__)
    constexpr bool avx512 = true;
#else
    constexpr bool avx512 = false;
#endif
#if defined(__AVX512F__) || defined(__AVX2__)
    if ((avx512 ? D == 64 || D == 128 : D % 64 == 0 && KVH > 1) && Dv == D && t0 < t1) {
      thread_local std::vector<const float*> qgs;
      thread_local std::vector<float*> parts;
      qgs.resize(KVH);
      parts.resize(KVH);
      if (ql > 1) qbuf.resize(KVH * R * D);
      for (int64_t g = 0; g < KVH; ++g) {
        parts[g] = part_at(b, g, s);
        const float* qg = q + (qstart[b] * H + g * G) * D;
        if (ql > 1) {  // the request's queries for kv head g, row j * G + h
          for (int64_t j = 0; j < ql; ++j)
            std::memcpy(qbuf.data() + (g * R + j * G) * D, qg + j * H * D, G * D * sizeof(float));
          qg = qbuf.data() + g * R * D;
        }
        qgs[g] = qg;
      }
      scores.resize(KVH * R * (t1 - t0));
#if defined(__AVX512F__)
      if (D == 64)
        attend_heads_avx512<KV, 4>(qgs.data(), kc, vc, offs.data(), t0, t1, R, KVH, scale, lim.data(),
                                   parts.data(), scores.data());
      else
        attend_heads_avx512<KV, 8>(qgs.data(), kc, vc, offs.data(), t0, t1, R, KVH, scale, lim.data(),
                                   parts.data(), scores.data());
#else
      attend_heads_avx2<KV>(qgs.data(), kc, vc, offs.data(), t0, t1, R, KVH, D, scale, lim.data(),
                            parts.data(), scores.data());
#endif
      return;
    }
#endif
#if defined(__AVX512F__)
    if constexpr (!scaled_rows<KV>) {  // (MLA refuses the int8 and fp8 formats)
      if (KVH == 1 && D % 16 == 0 && t0 < t1) {  // MLA's latent row (absorbed decode)
        const float* qg = q + qstart[b] * H * D;  // rows j * G + h: already in that order
        scores.resize(R * (t1 - t0));
        attend_wide_avx512<KV>(qg, kc, vc, offs.data(), t0, t1, R, D, Dv, scale, lim.data(),
                               part_at(b, 0, s), scores.data());
        return;
      }
    }
#endif
    for (int64_t g = 0; g < KVH; ++g) {
      float* part = part_at(b, g, s);
      if (t0 >= t1) {
        for (int64_t h = 0; h < R; ++h) part[h * pstride] = -INFINITY, part[h * pstride + 1] = 0;
        continue;
      }
      const float* qg = q + (qstart[b] * H + g * G) * D;
      if (ql > 1) {  // the request's queries for kv head g, row j * G + h
        qbuf.resize(R * D);
        for (int64_t j = 0; j < ql; ++j)
          std::memcpy(qbuf.data() + j * G * D, qg + j * H * D, G * D * sizeof(float));
        qg = qbuf.data();
      }
      scores.resize(R * (t1 - t0));
      attend_generic<KV>(qg, kc, vc, offs.data(), t0, t1, R, KVH, g, D, Dv, scale,
                 lim.data(), part, scores.data());
    }
  };
  auto merge_fn = [&](int64_t b) {
    for (int64_t j = 0; j < qlen[b]; ++j)
      for (int64_t h = 0; h < H; ++h)
        merge_splits(part_at(b, h / G, 0) + (j * G + h % G) * pstride, num_splits, RG * pstride, Dv,
                     out + ((qstart[b] + j) * H + h) * D);
  };
  const int64_t items = B * num_splits;
  // A short context is less work than waking the thread team: run it on this thread.
  if (total * H * D < (1 << 18)) {
    for (int64_t i = 0; i < items; ++i) item_fn(i);
    for (int64_t b = 0; b < B; ++b) merge_fn(b);
    return;
  }
  parallel_tasks(items, item_fn, threads);
  parallel_tasks(B, merge_fn, threads);
}

// q [T, H, D] float32: the new tokens of B requests, packed in request order; caches
// [num_blocks, block_size, KVH, D] (int8: D + 4, kv_quant.py); block_tables [B, max_blocks] int32; context_lens [B] int32;
// query_lens [B] int32 (each 1 when absent: one decode token per request). Returns [T, H, D].
// v_dim (< D, a multiple of 16; mla_layers.h): only the first v_dim values of each row are V
// -- MLA's latent [c | k_pe], whose rope part is a key only -- and only out[..., :v_dim] is
// written (0: all D).
at::Tensor decode_attention_v(const at::Tensor& q_in, const at::Tensor& k_cache,
                              const at::Tensor& v_cache, const at::Tensor& block_tables_in,
                              const at::Tensor& context_lens_in, double scale, int64_t split,
                              int64_t threads, const std::optional<at::Tensor>& query_lens_in,
                              int64_t v_dim) {
  at::Tensor q = q_in.contiguous();
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.dim() == 3, "decode_attention: q float32 [T, H, D]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4,
              "decode_attention: cache [num_blocks, block_size, KVH, D]");
  at::Tensor tables = block_tables_in.to(at::kInt).contiguous();
  at::Tensor ctx = context_lens_in.to(at::kInt).contiguous();
  const int64_t B = ctx.numel(), T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t block_size = k_cache.size(1), KVH = k_cache.size(2);
  TORCH_CHECK(H % KVH == 0 && k_cache.size(3) == (is_scaled_cache(k_cache) ? D + kScaleBytes : D),
              "decode_attention: head shapes");
  const int64_t Dv = v_dim > 0 ? v_dim : D;
  TORCH_CHECK(Dv == D || (Dv < D && Dv % 16 == 0), "decode_attention: v_dim ", Dv,
              " must be the head size or a multiple of 16 below it");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == B, "decode_attention: one block table per request");
  at::Tensor qlens = query_lens_in.has_value() ? query_lens_in->to(at::kInt).contiguous()
                                               : at::ones({B}, ctx.options());
  TORCH_CHECK(qlens.numel() == B, "decode_attention: one query length per request");
  const int32_t* cp = ctx.data_ptr<int32_t>();
  const int32_t* qp = qlens.data_ptr<int32_t>();
  std::vector<int64_t> qstart(B);
  int64_t max_ctx = 1, max_q = 1, rows = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(qp[b] >= 1 && qp[b] <= cp[b], "decode_attention: query length outside [1, context]");
    TORCH_CHECK(static_cast<int64_t>(cp[b]) <= tables.size(1) * block_size,
                "decode_attention: context longer than its block table");
    qstart[b] = rows;
    rows += qp[b];
    max_ctx = std::max<int64_t>(max_ctx, cp[b]);
    max_q = std::max<int64_t>(max_q, qp[b]);
  }
  TORCH_CHECK(rows == T, "decode_attention: q has ", T, " rows, the query lengths sum to ", rows);
  split = std::max<int64_t>(split, block_size);
  // Fewer (request, split) items than threads leave cores idle. Where a request's context is
  // work enough for it (MLA: 16 query heads on one 320-wide bf16 latent row at 200 tokens, 36 us
  // on one thread -> 26 on two), the splits are cut so every thread gets one; a dense model's
  // short contexts (a few us) stay one item, with no parallel region.
  const int64_t nt = std::min<int64_t>(threads, at::get_num_threads());
  if (B * ((max_ctx + split - 1) / split) < nt && max_ctx * H * D >= nt * (int64_t{1} << 18)) {
    const int64_t per = (nt + B - 1) / B;  // items wanted per request
    split = std::max<int64_t>(block_size, ((max_ctx + per - 1) / per + block_size - 1) /
                                              block_size * block_size);
  }
  // The partial results hold (max, sum, output row) per query row, head and split. Many rows
  // over a long context (DeepSeek-V3's 128 heads of 576 in a 16-token verify step at 128k:
  // 1.2 GB, written and page-faulted per layer) take fewer, longer splits instead, so they stay
  // under kPartialBytes (each item's scores grow to rows x split floats), keeping at least a
  // split per thread.
  constexpr int64_t kPartialBytes = int64_t{64} << 20;
  const int64_t split_bytes = B * max_q * H * (D + 2) * int64_t{sizeof(float)};
  if ((max_ctx + split - 1) / split * split_bytes > kPartialBytes) {
    const int64_t most = std::max<int64_t>(kPartialBytes / split_bytes, (nt + B - 1) / B);
    split = std::max<int64_t>(split, ((max_ctx + most - 1) / most + block_size - 1) / block_size *
                                         block_size);
  }
  const int64_t num_splits = (max_ctx + split - 1) / split;
  at::Tensor partial = at::empty({B * KVH * num_splits * max_q * (H / KVH) * (D + 2)}, q.options());
  at::Tensor out = at::empty_like(q);
  const int64_t max_blocks = tables.size(1);
  auto run = [&](auto* kc, auto* vc) {
    decode_attention_impl(q.data_ptr<float>(), kc, vc, tables.data_ptr<int32_t>(), cp, qp,
                          qstart.data(), B, H, KVH, D, Dv, block_size, max_blocks,
                          static_cast<float>(scale), split, num_splits, max_q,
                          partial.data_ptr<float>(), out.data_ptr<float>(), threads);
  };
  if (k_cache.scalar_type() == at::kChar) {
    run(act_ptr<const int8_t>(k_cache), act_ptr<const int8_t>(v_cache));
  } else if (is_fp8_cache(k_cache)) {
    run(act_ptr<const e4m3>(k_cache), act_ptr<const e4m3>(v_cache));
  } else if (k_cache.scalar_type() == at::kBFloat16) {
    decode_attention_impl<uint16_t>(
        q.data_ptr<float>(), reinterpret_cast<const uint16_t*>(k_cache.data_ptr()),
        reinterpret_cast<const uint16_t*>(v_cache.data_ptr()), tables.data_ptr<int32_t>(), cp, qp,
        qstart.data(), B, H, KVH, D, Dv, block_size, max_blocks, static_cast<float>(scale), split,
        num_splits, max_q, partial.data_ptr<float>(), out.data_ptr<float>(), threads);
  } else {
    TORCH_CHECK(k_cache.scalar_type() == at::kFloat,
                "decode_attention: cache float32, bfloat16, int8 or float8_e4m3fn");
    decode_attention_impl<float>(q.data_ptr<float>(), k_cache.data_ptr<float>(),
                                 v_cache.data_ptr<float>(), tables.data_ptr<int32_t>(), cp, qp,
                                 qstart.data(), B, H, KVH, D, Dv, block_size, max_blocks,
                                 static_cast<float>(scale), split, num_splits, max_q,
                                 partial.data_ptr<float>(), out.data_ptr<float>(), threads);
  }
  return out;
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, double scale, int64_t split,
                            int64_t threads, const std::optional<at::Tensor>& query_lens) {
  return decode_attention_v(q, k_cache, v_cache, block_tables, context_lens, scale, split,
                            threads, query_lens, 0);
}
