// Prefill attention over the paged cache (flash-style tiles: AVX-512, AVX2 and generic).
//
// A fragment of hearth's one kernel build: included by cpu_kernels.cpp inside
// namespace hearth::(anonymous), after the headers listed before it there.

// ---------------------------------------------------------------------------------------------
// Prefill attention over the paged cache: one request's chunk of q_len queries, the last of its
// ctx_len tokens (query i sits at position ctx_len - q_len + i and sees tokens [0, position]),
// K/V read in place through its block table (a prefix hit is not gathered first), causal with
// the diagonal offset by the cached prefix. Flash-style: the scores of a query tile against one
// key tile at a time, with a running max and sum per query row.
//
//   work item = (kv head g, query tile): QT = kRows / G query positions x the G query heads of
//   kv head g, so one key tile's loads feed every head that shares it (GQA without copies).
//   Scores are computed transposed, S^T[key][row] = K[key] . Q[row], with the rows across the
//   vector lanes: a key's K row entries are broadcast against Q^T (transposed once per item), the
//   row max and sum are lane-wise, and P^T[key][row] is broadcast against V's rows for the output.
//   Key tiles beyond a query tile's last position are never computed.

constexpr int64_t kRows = 48;   // query rows per item (3 vectors of 16)
constexpr int64_t kKeys = 64;   // keys per tile
constexpr float kLog2e = 1.44269504088896341f;

struct PrefillShape {
  int64_t H, KVH, G, D, block_size, ctx_len, q_len, QT;
};

// The start of a float32 item (the AVX-512 and AVX2 tiles): Q^T [D][kRows] of its rows (row r:
// query first + r / G, head g G + r % G) scaled by scale * log2(e), padding rows zero; each
// row's position (padding sees every key) and a fresh running max and sum.
inline void start_float_item(const float* q, const PrefillShape& s, int64_t g, int64_t first,
                             int64_t rows, int64_t pos0, int64_t D, float scale, float* qt,
                             int32_t* qpos, float* m, float* l) {
  const int64_t G = s.G;
  const float qscale = scale * kLog2e;
  for (int64_t r = 0; r < kRows; ++r) {
    const bool real = r < rows;
    const float* qr = real ? q + ((first + r / G) * s.H + g * G + r % G) * D : nullptr;
    for (int64_t d = 0; d < D; ++d) qt[d * kRows + r] = real ? qr[d] * qscale : 0.0f;
    qpos[r] = real ? static_cast<int32_t>(pos0 + r / G) : INT32_MAX;
    m[r] = -INFINITY;
    l[r] = 0.0f;
  }
}

#if defined(__AVX512F__)
// 2^x, relative error ~2e-7; x below -126 gives ~2^-126 (callers zero masked entries).
inline __m512 exp2_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(x, n), _mm512_set1_ps(0.69314718055994531f));
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// One key tile of the flash loop's online softmax, shared by the float32 and bf16 tiles:
// S^T [jpad][kRows] in st -> P^T in place (the causal mask only on tiles that reach past the
// query tile's first position pos0), the running max m and sum l updated per row, and al[r]
// the factor the row's output so far is to be scaled by.
inline void softmax_tile(float* st, float* m, float* l, float* al, const __m512i* qposv,
                         int64_t j0, int64_t jpad, int64_t pos0) {
  constexpr int64_t RV = kRows / 16;
  const bool masked = j0 + jpad - 1 > pos0;
  __m512 mx[RV], alpha[RV], sum[RV];
  for (int v = 0; v < RV; ++v) mx[v] = _mm512_load_ps(m + 16 * v);
  for (int64_t j = 0; j < jpad; ++j)
    for (int v = 0; v < RV; ++v) {
      __m512 x = _mm512_load_ps(st + j * kRows + 16 * v);
      if (masked) {
        const __mmask16 hide = _mm512_cmpgt_epi32_mask(
            _mm512_set1_epi32(static_cast<int32_t>(j0 + j)), qposv[v]);
        x = _mm512_mask_mov_ps(x, hide, _mm512_set1_ps(-INFINITY));
        _mm512_store_ps(st + j * kRows + 16 * v, x);
      }
      mx[v] = _mm512_max_ps(mx[v], x);
    }
  for (int v = 0; v < RV; ++v) {
    const __m512 old = _mm512_load_ps(m + 16 * v);
    alpha[v] = exp2_ps(_mm512_sub_ps(old, mx[v]));  // old = -inf (first tile): ~0, o and l are 0
    sum[v] = _mm512_mul_ps(_mm512_load_ps(l + 16 * v), alpha[v]);
    _mm512_store_ps(m + 16 * v, mx[v]);
  }
  for (int64_t j = 0; j < jpad; ++j)
    for (int v = 0; v < RV; ++v) {
      const __m512 x = _mm512_load_ps(st + j * kRows + 16 * v);
      __m512 p = exp2_ps(_mm512_sub_ps(x, mx[v]));
      if (masked) p = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ), p);
      sum[v] = _mm512_add_ps(sum[v], p);
      _mm512_store_ps(st + j * kRows + 16 * v, p);
    }
  for (int v = 0; v < RV; ++v) {
    _mm512_store_ps(l + 16 * v, sum[v]);
    _mm512_store_ps(al + 16 * v, alpha[v]);
  }
}

template <typename KV, int DV>
void prefill_item_avx512(const float* q, const KV* kc, const KV* vc, const int32_t* table,
                         const PrefillShape& s, int64_t g, int64_t tile, float scale, float* out) {
  constexpr int64_t D = 16 * DV, RV = kRows / 16, RS = row_stride<KV>(D);
  constexpr int RB = DV <= 4 ? 6 : 3;  // output rows per pass: RB * DV accumulators + DV values
  const int64_t G = s.G, first = tile * s.QT;  // first query of the tile (chunk index)
  const int64_t npos = std::min(s.QT, s.q_len - first), rows = npos * G;
  const int64_t pos0 = s.ctx_len - s.q_len + first, key_end = pos0 + npos;
  alignas(64) float qt[D * kRows];      // Q^T, scaled by scale * log2(e)
  alignas(64) float st[kKeys * kRows];  // S^T, then P^T
  alignas(64) float o[kRows * D];
  alignas(64) float m[kRows], l[kRows];
  alignas(64) int32_t qpos[kRows];
  alignas(64) float kbuf[std::is_same_v<KV, float> ? 1 : kKeys * D];
  alignas(64) float vbuf[std::is_same_v<KV, float> ? 1 : kKeys * D];
  alignas(64) static const float zero_row[D] = {};
  start_float_item(q, s, g, first, rows, pos0, D, scale, qt, qpos, m, l);
  std::memset(o, 0, sizeof(o));
  __m512i qposv[RV];
  for (int v = 0; v < RV; ++v) qposv[v] = _mm512_load_si512(qpos + 16 * v);
  const float* krow[kKeys];
  const float* vrow[kKeys];
  for (int64_t j0 = 0; j0 < key_end; j0 += kKeys) {
    const int64_t jn = std::min(kKeys, key_end - j0), jpad = (jn + 7) / 8 * 8;
    for_each_slot(table, s.block_size, j0, j0 + jn, [&](int64_t t, int64_t slot) {
      const int64_t j = t - j0, off = (slot * s.KVH + g) * RS;
      if constexpr (std::is_same_v<KV, float>) {
        krow[j] = kc + off;
        vrow[j] = vc + off;
      } else if constexpr (scaled_rows<KV>) {  // widened and scaled as the tile is loaded
        const __m512 ks = _mm512_set1_ps(row_scale(kc + off, D)), vs = _mm512_set1_ps(row_scale(vc + off, D));
        for (int c = 0; c < DV; ++c) {
          _mm512_store_ps(kbuf + j * D + 16 * c, _mm512_mul_ps(load16(kc + off + 16 * c), ks));
          _mm512_store_ps(vbuf + j * D + 16 * c, _mm512_mul_ps(load16(vc + off + 16 * c), vs));
        }
        krow[j] = kbuf + j * D;
        vrow[j] = vbuf + j * D;
      } else {
        for (int c = 0; c < DV; ++c) {
          _mm512_store_ps(kbuf + j * D + 16 * c, load16(kc + off + 16 * c));
          _mm512_store_ps(vbuf + j * D + 16 * c, load16(vc + off + 16 * c));
        }
        krow[j] = kbuf + j * D;
        vrow[j] = vbuf + j * D;
      }
    });
    for (int64_t j = jn; j < jpad; ++j) krow[j] = vrow[j] = zero_row;
    // S^T = K Q^T: 8 keys x 48 rows in 24 accumulators.
    for (int64_t jb = 0; jb < jpad; jb += 8) {
      __m512 acc[8][RV];
      for (int jj = 0; jj < 8; ++jj)
        for (int v = 0; v < RV; ++v) acc[jj][v] = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; ++d) {
        __m512 qv[RV];
        for (int v = 0; v < RV; ++v) qv[v] = _mm512_load_ps(qt + d * kRows + 16 * v);
        for (int jj = 0; jj < 8; ++jj) {
          const __m512 kb = _mm512_set1_ps(krow[jb + jj][d]);
          for (int v = 0; v < RV; ++v) acc[jj][v] = _mm512_fmadd_ps(kb, qv[v], acc[jj][v]);
        }
      }
      for (int jj = 0; jj < 8; ++jj)
        for (int v = 0; v < RV; ++v) _mm512_store_ps(st + (jb + jj) * kRows + 16 * v, acc[jj][v]);
    }
    alignas(64) float al[kRows];
    softmax_tile(st, m, l, al, qposv, j0, jpad, pos0);  // mask, P^T in place, m, l, rescale
    // O = O * alpha + P V, RB rows at a time.
    for (int64_t r0 = 0; r0 < rows; r0 += RB) {
      const int rn = static_cast<int>(std::min<int64_t>(RB, rows - r0));
      __m512 acc[RB][DV];
      for (int rr = 0; rr < RB; ++rr) {
        if (rr >= rn) break;
        const __m512 a = _mm512_set1_ps(al[r0 + rr]);
        for (int c = 0; c < DV; ++c)
          acc[rr][c] = _mm512_mul_ps(_mm512_load_ps(o + (r0 + rr) * D + 16 * c), a);
      }
      for (int64_t j = 0; j < jn; ++j) {
        __m512 vv[DV];
        for (int c = 0; c < DV; ++c) vv[c] = _mm512_loadu_ps(vrow[j] + 16 * c);
        for (int rr = 0; rr < RB; ++rr) {
          if (rr >= rn) break;
          const __m512 p = _mm512_set1_ps(st[j * kRows + r0 + rr]);
          for (int c = 0; c < DV; ++c) acc[rr][c] = _mm512_fmadd_ps(p, vv[c], acc[rr][c]);
        }
      }
      for (int rr = 0; rr < RB; ++rr) {
        if (rr >= rn) break;
        for (int c = 0; c < DV; ++c) _mm512_store_ps(o + (r0 + rr) * D + 16 * c, acc[rr][c]);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* dst = out + ((first + r / G) * s.H + g * G + r % G) * D;
    const __m512 inv = _mm512_set1_ps(1.0f / l[r]);
    for (int c = 0; c < DV; ++c)
      _mm512_storeu_ps(dst + 16 * c, _mm512_mul_ps(_mm512_load_ps(o + r * D + 16 * c), inv));
  }
}

// A bf16 cache on AVX512-BF16 (Zen 4, Sapphire Rapids without AMX's tile path): the same flash
// loop with bf16 dot products, 32 multiply-adds per vdpbf16ps instead of 16 per FMA, and the
// cached rows used as stored (no widened copy of each tile). S^T: Q^T is kept as pairs of
// adjacent dims (bf16 of q[r][2i], q[r][2i + 1], scaled), one key's dim pair broadcast from the
// cache against them. O += P V: two keys' V rows interleaved (16-bit unpacks) against the
// broadcast pair (P[j][r], P[j + 1][r]); the unpacks leave each 32-value chunk of the output
// in (lo, hi) lane order, put back when the item's rows are written. The query (times its scale)
// and P are rounded to bf16, as the cached K/V already are (MLA's decode on bf16 caches does
// the same, decode_attention.h); sums, max and exp in float32.
template <int DV>
HEARTH_TARGET_BF16 void prefill_item_bf16(const float* q, const uint16_t* kc, const uint16_t* vc,
                                          const int32_t* table, const PrefillShape& s, int64_t g,
                                          int64_t tile, float scale, float* out) {
  constexpr int64_t D = 16 * DV, RV = kRows / 16, DP = D / 2, VC = D / 32;
  constexpr int RB = DV <= 4 ? 6 : 2;  // RB * VC * 2 accumulators + 2 * VC value registers
  const int64_t G = s.G, first = tile * s.QT;
  const int64_t npos = std::min(s.QT, s.q_len - first), rows = npos * G;
  const int64_t pos0 = s.ctx_len - s.q_len + first, key_end = pos0 + npos;
  alignas(64) uint32_t qt[DP * kRows];      // Q^T in dim pairs, scaled by scale * log2(e)
  alignas(64) float st[kKeys * kRows];      // S^T, then P^T
  alignas(64) uint32_t pp[kKeys / 2 * kRows];  // P^T in key pairs
  alignas(64) float o[kRows * D];           // per 32-value chunk: 16 (lo) + 16 (hi) lanes
  alignas(64) float m[kRows], l[kRows];
  alignas(64) int32_t qpos[kRows];
  alignas(64) static const uint16_t zero_row[D] = {};
  const float qscale = scale * kLog2e;
  for (int64_t r = 0; r < kRows; ++r) {
    const bool real = r < rows;
    const float* qr = real ? q + ((first + r / G) * s.H + g * G + r % G) * D : nullptr;
    for (int64_t i = 0; i < DP; ++i)
      qt[i * kRows + r] = real ? float_to_bf16(qr[2 * i] * qscale) |
                                     static_cast<uint32_t>(float_to_bf16(qr[2 * i + 1] * qscale)) << 16
                               : 0u;
    qpos[r] = real ? static_cast<int32_t>(pos0 + r / G) : INT32_MAX;
    m[r] = -INFINITY;
    l[r] = 0.0f;
  }
  std::memset(o, 0, sizeof(o));
  __m512i qposv[RV];
  for (int v = 0; v < RV; ++v) qposv[v] = _mm512_load_si512(qpos + 16 * v);
  // word 2r <- P[j][r] (lanes 0..15 of cvtne2ps's result), word 2r + 1 <- P[j + 1][r] (16..31)
  alignas(64) static const int16_t pair_order[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                     8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i pidx = _mm512_load_si512(pair_order);
  const uint16_t* krow[kKeys];
  const uint16_t* vrow[kKeys];
  for (int64_t j0 = 0; j0 < key_end; j0 += kKeys) {
    const int64_t jn = std::min(kKeys, key_end - j0), jpad = (jn + 7) / 8 * 8;
    for_each_slot(table, s.block_size, j0, j0 + jn, [&](int64_t t, int64_t slot) {
      const int64_t off = (slot * s.KVH + g) * D;
      krow[t - j0] = kc + off;
      vrow[t - j0] = vc + off;
    });
    // the next tile's rows into L2 while this one computes (its blocks lie anywhere in the pool)
    for_each_slot(table, s.block_size, j0 + jn, std::min(key_end, j0 + jn + kKeys),
                  [&](int64_t, int64_t slot) {
      const int64_t off = (slot * s.KVH + g) * D;
      for (int64_t x = 0; x < D; x += 32) {
        _mm_prefetch(reinterpret_cast<const char*>(kc + off + x), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(vc + off + x), _MM_HINT_T1);
      }
    });
    for (int64_t j = jn; j < jpad; ++j) krow[j] = vrow[j] = zero_row;
    for (int64_t jb = 0; jb < jpad; jb += 8) {
      __m512 acc[8][RV];
      for (int jj = 0; jj < 8; ++jj)
        for (int v = 0; v < RV; ++v) acc[jj][v] = _mm512_setzero_ps();
      for (int64_t i = 0; i < DP; ++i) {
        __m512bh qv[RV];
        for (int v = 0; v < RV; ++v)
          qv[v] = reinterpret_cast<__m512bh>(_mm512_load_si512(qt + i * kRows + 16 * v));
        for (int jj = 0; jj < 8; ++jj) {
          int32_t kp;
          std::memcpy(&kp, krow[jb + jj] + 2 * i, sizeof(kp));
          const __m512bh kb = reinterpret_cast<__m512bh>(_mm512_set1_epi32(kp));
          for (int v = 0; v < RV; ++v) acc[jj][v] = _mm512_dpbf16_ps(acc[jj][v], kb, qv[v]);
        }
      }
      for (int jj = 0; jj < 8; ++jj)
        for (int v = 0; v < RV; ++v) _mm512_store_ps(st + (jb + jj) * kRows + 16 * v, acc[jj][v]);
    }
    alignas(64) float al[kRows];
    softmax_tile(st, m, l, al, qposv, j0, jpad, pos0);  // mask, P^T in place, m, l, rescale
    const int64_t np = (jn + 1) / 2;  // key pairs (a padded key's P is 0, its row zeros)
    for (int64_t jp = 0; jp < np; ++jp)
      for (int v = 0; v < RV; ++v) {
        const __m512i two = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(
            _mm512_load_ps(st + (2 * jp + 1) * kRows + 16 * v), _mm512_load_ps(st + 2 * jp * kRows + 16 * v)));
        _mm512_store_si512(pp + jp * kRows + 16 * v, _mm512_permutexvar_epi16(pidx, two));
      }
    for (int64_t r0 = 0; r0 < rows; r0 += RB) {
      const int rn = static_cast<int>(std::min<int64_t>(RB, rows - r0));
      __m512 acc[RB][VC][2];
      for (int rr = 0; rr < RB; ++rr) {
        if (rr >= rn) break;
        const __m512 a = _mm512_set1_ps(al[r0 + rr]);
        for (int c = 0; c < VC; ++c)
          for (int h = 0; h < 2; ++h)
            acc[rr][c][h] = _mm512_mul_ps(_mm512_load_ps(o + (r0 + rr) * D + 32 * c + 16 * h), a);
      }
      for (int64_t jp = 0; jp < np; ++jp) {
        __m512bh vv[VC][2];
        for (int c = 0; c < VC; ++c) {
          const __m512i a = _mm512_loadu_si512(vrow[2 * jp] + 32 * c);
          const __m512i b = _mm512_loadu_si512(vrow[2 * jp + 1] + 32 * c);
          vv[c][0] = reinterpret_cast<__m512bh>(_mm512_unpacklo_epi16(a, b));
          vv[c][1] = reinterpret_cast<__m512bh>(_mm512_unpackhi_epi16(a, b));
        }
        for (int rr = 0; rr < RB; ++rr) {
          if (rr >= rn) break;
          const __m512bh p = reinterpret_cast<__m512bh>(
              _mm512_set1_epi32(static_cast<int>(pp[jp * kRows + r0 + rr])));
          for (int c = 0; c < VC; ++c)
            for (int h = 0; h < 2; ++h) acc[rr][c][h] = _mm512_dpbf16_ps(acc[rr][c][h], p, vv[c][h]);
        }
      }
      for (int rr = 0; rr < RB; ++rr) {
        if (rr >= rn) break;
        for (int c = 0; c < VC; ++c)
          for (int h = 0; h < 2; ++h)
            _mm512_store_ps(o + (r0 + rr) * D + 32 * c + 16 * h, acc[rr][c][h]);
      }
    }
  }
  const __m512i lo_idx = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i hi_idx = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t r = 0; r < rows; ++r) {
    float* dst = out + ((first + r / G) * s.H + g * G + r % G) * D;
    const __m512 inv = _mm512_set1_ps(1.0f / l[r]);
    for (int c = 0; c < VC; ++c) {
      const __m512 lo = _mm512_load_ps(o + r * D + 32 * c), hi = _mm512_load_ps(o + r * D + 32 * c + 16);
      _mm512_storeu_ps(dst + 32 * c, _mm512_mul_ps(_mm512_permutex2var_ps(lo, lo_idx, hi), inv));
      _mm512_storeu_ps(dst + 32 * c + 16, _mm512_mul_ps(_mm512_permutex2var_ps(lo, hi_idx, hi), inv));
    }
  }
}
#endif

#include "prefill_attention_avx2.h"  // prefill_item_avx2: the flash tile on AVX2 + FMA

// Any build and head size: the same flash loop, one query row at a time, in plain loops.
template <typename KV>
void prefill_item_generic(const float* q, const KV* kc, const KV* vc, const int32_t* table,
                          const PrefillShape& s, int64_t g, int64_t tile, float scale, float* out) {
  const int64_t D = s.D, G = s.G, first = tile * s.QT, rs = row_stride<KV>(D);
  const int64_t npos = std::min(s.QT, s.q_len - first);
  thread_local std::vector<float> acc, sc;
  acc.resize(D);
  sc.resize(kKeys);
  for (int64_t r = 0; r < npos * G; ++r) {
    const float* qr = q + ((first + r / G) * s.H + g * G + r % G) * D;
    const int64_t pos = s.ctx_len - s.q_len + first + r / G;
    float mx = -INFINITY, sum = 0;
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t j0 = 0; j0 <= pos; j0 += kKeys) {
      const int64_t jn = std::min(kKeys, pos + 1 - j0);
      float tmx = mx;
      for (int64_t j = 0; j < jn; ++j) {
        const int64_t t = j0 + j;
        const int64_t slot = static_cast<int64_t>(table[t / s.block_size]) * s.block_size + t % s.block_size;
        const KV* k = kc + (slot * s.KVH + g) * rs;
        float dot = 0;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += qr[d] * load_kv(k, d);
        sc[j] = dot * scale * row_scale(k, D);
        tmx = std::max(tmx, sc[j]);
      }
      const float alpha = fast_exp(mx - tmx);
      sum *= alpha;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) acc[d] *= alpha;
      for (int64_t j = 0; j < jn; ++j) {
        const int64_t t = j0 + j;
        const int64_t slot = static_cast<int64_t>(table[t / s.block_size]) * s.block_size + t % s.block_size;
        const KV* v = vc + (slot * s.KVH + g) * rs;
        const float p = fast_exp(sc[j] - tmx), pv = p * row_scale(v, D);
        sum += p;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) acc[d] += pv * load_kv(v, d);
      }
      mx = tmx;
    }
    float* dst = out + ((first + r / G) * s.H + g * G + r % G) * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = acc[d] / sum;
  }
}

template <typename KV>
void prefill_attention_impl(const float* q, const KV* kc, const KV* vc, const int32_t* table,
                            const PrefillShape& s, float scale, float* out, int64_t threads) {
  const int64_t tiles = (s.q_len + s.QT - 1) / s.QT, items = tiles * s.KVH;
  parallel_tasks(items, [&](int64_t item) {
    // Last tiles first: they see the most keys, so the tail of the queue is the short work.
#if defined(__AVX512F__)
    const int64_t tile = tiles - 1 - item / s.KVH, g = item % s.KVH;
#else
    // One KV head's tiles in a row: the threads stream the same K/V rows at about the same
    // time, so one read from memory serves both (AVX2, 2 threads, 2k queries over 8k: 115 -> 148
    // GFLOP/s; 128 over 16k: 101 -> 115).
    const int64_t tile = tiles - 1 - item % tiles, g = item / tiles;
#endif
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<KV, uint16_t>) {
      if (bf16_dot_products()) {
        if (s.D == 64) return prefill_item_bf16<4>(q, kc, vc, table, s, g, tile, scale, out);
        if (s.D == 128) return prefill_item_bf16<8>(q, kc, vc, table, s, g, tile, scale, out);
      }
    }
    if (s.D == 64) return prefill_item_avx512<KV, 4>(q, kc, vc, table, s, g, tile, scale, out);
    if (s.D == 128) return prefill_item_avx512<KV, 8>(q, kc, vc, table, s, g, tile, scale, out);
#elif defined(__AVX2__)
    if (s.D == 64) return prefill_item_avx2<KV, 2>(q, kc, vc, table, s, g, tile, scale, out);
    if (s.D == 128) return prefill_item_avx2<KV, 4>(q, kc, vc, table, s, g, tile, scale, out);
#endif
    prefill_item_generic<KV>(q, kc, vc, table, s, g, tile, scale, out);
  }, threads);
}

// q [q_len, H, D] float32 (the chunk's queries); caches [num_blocks, block_size, KVH, D] float32
// or bfloat16 holding the chunk's own K/V already; block_table [>= ctx_len / block_size] int32.
// Returns [q_len, H, D].
// The checks both prefill kernels make of a chunk of q_len queries (the last of ctx_len tokens)
// over a paged cache; returns the block table as int32.
at::Tensor check_chunk_over_cache(const char* op, int64_t q_len, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_table_in,
                                  int64_t ctx_len) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4 &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type(),
              op, ": caches [num_blocks, block_size, KVH, D], alike");
  TORCH_CHECK(q_len >= 1 && q_len <= ctx_len, op, ": query length outside [1, context]");
  at::Tensor table = block_table_in.to(at::kInt).contiguous();
  const int64_t bs = k_cache.size(1);
  TORCH_CHECK(table.dim() == 1 && ctx_len <= table.numel() * bs,
              op, ": context longer than its block table");
  const int32_t* tp = table.data_ptr<int32_t>();
  const int64_t num_blocks = k_cache.size(0), used = (ctx_len + bs - 1) / bs;
  for (int64_t i = 0; i < used; ++i)
    TORCH_CHECK(tp[i] >= 0 && tp[i] < num_blocks, op, ": block id out of range");
  return table;
}

at::Tensor prefill_attention(const at::Tensor& q_in, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& block_table_in,
                             int64_t ctx_len, double scale, int64_t threads) {
  at::Tensor q = q_in.contiguous();
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.dim() == 3, "prefill_attention: q float32 [T, H, D]");
  at::Tensor table =
      check_chunk_over_cache("prefill_attention", q.size(0), k_cache, v_cache, block_table_in, ctx_len);
  PrefillShape s{q.size(1), k_cache.size(2), 0, q.size(2), k_cache.size(1), ctx_len, q.size(0), 0};
  TORCH_CHECK(s.H % s.KVH == 0 && k_cache.size(3) == (is_scaled_cache(k_cache) ? s.D + kScaleBytes : s.D),
              "prefill_attention: head shapes");
  s.G = s.H / s.KVH;
  TORCH_CHECK(s.G <= kRows, "prefill_attention: more than ", kRows, " query heads per kv head");
  s.QT = kRows / s.G;
  const int32_t* tp = table.data_ptr<int32_t>();
  at::Tensor out = at::empty_like(q);
  if (k_cache.scalar_type() == at::kChar) {
    prefill_attention_impl(q.data_ptr<float>(), act_ptr<const int8_t>(k_cache),
                           act_ptr<const int8_t>(v_cache), tp, s, static_cast<float>(scale),
                           out.data_ptr<float>(), threads);
  } else if (is_fp8_cache(k_cache)) {
    prefill_attention_impl(q.data_ptr<float>(), act_ptr<const e4m3>(k_cache),
                           act_ptr<const e4m3>(v_cache), tp, s, static_cast<float>(scale),
                           out.data_ptr<float>(), threads);
  } else if (k_cache.scalar_type() == at::kBFloat16) {
    prefill_attention_impl<uint16_t>(q.data_ptr<float>(),
                                     reinterpret_cast<const uint16_t*>(k_cache.data_ptr()),
                                     reinterpret_cast<const uint16_t*>(v_cache.data_ptr()), tp, s,
                                     static_cast<float>(scale), out.data_ptr<float>(), threads);
  } else {
    TORCH_CHECK(k_cache.scalar_type() == at::kFloat,
                "prefill_attention: cache float32, bfloat16, int8 or float8_e4m3fn");
    prefill_attention_impl<float>(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                                  tp, s, static_cast<float>(scale), out.data_ptr<float>(), threads);
  }
  return out;
}
