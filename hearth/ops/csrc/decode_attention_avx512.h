// Decode attention's AVX-512 row kernels (attend_heads_avx512, the bf16 dot-product wide path,
// attend_wide_avx512): every KV head of one work item at once.
//
// A fragment of hearth's one kernel build: included by decode_attention.h after its generic
// loops (load_kv, softmax_scores, attend_generic), whose helpers these share.

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
