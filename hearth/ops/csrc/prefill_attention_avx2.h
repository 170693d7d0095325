// Prefill attention's AVX2 + FMA flash tile (prefill_item_avx2), for builds without AVX-512.
//
// A fragment of hearth's one kernel build: included by prefill_attention.h after its shared
// definitions (kRows, kKeys, kLog2e, PrefillShape) and before prefill_attention_impl, which picks
// it; the KV loads (load8) and row scales come from decode_attention.h / decode_attention_avx2.h.
//
// The same flash loop as prefill_item_avx512 (the item, Q^T with the rows across the lanes,
// S^T = K Q^T, a running max and sum per row, O = O * alpha + P V), cut to AVX2's 16 vector
// registers of 8 lanes: S^T in blocks of 4 keys x 24 rows (12 accumulators, 3 query vectors,
// one broadcast key value), the output kept transposed too (O^T, rows across the lanes) in
// blocks of 4 values x 24 rows, and the causal mask by compares and blends instead of mask
// registers. Query vectors past the item's rows are
// not computed (a tile of fewer than 48 rows: the chunk's last, or G not dividing 48).
// Before it, an AVX2 build sent prompt chunks to torch's CPU flash kernel, which also needs
// the cached prefix gathered out of the paged cache first (TorchAttentionBackend.prompt_chunk).

#if !defined(__AVX512F__) && defined(__AVX2__)
// (exp2_ps8, the softmax tile's 2^x on 8 lanes: common.h)

// One key tile of the online softmax over the first nv row vectors: S^T [jpad][kRows] in st ->
// P^T in place (the causal mask only on a tile that reaches past the item's first position
// pos0), the running max m and sum l per row, and al[r], the factor row r's output so far is
// to be scaled by. One row vector at a time, so its max and sum stay in registers.
inline void softmax_tile_avx2(float* st, float* m, float* l, float* al, const int32_t* qpos,
                              int64_t j0, int64_t jpad, int64_t pos0, int nv) {
  const bool masked = j0 + jpad - 1 > pos0;
  const __m256 neg_inf = _mm256_set1_ps(-INFINITY);
  for (int v = 0; v < nv; ++v) {
    const __m256i qp = _mm256_load_si256(reinterpret_cast<const __m256i*>(qpos + 8 * v));
    const __m256 old = _mm256_load_ps(m + 8 * v);
    __m256 mx = old;
    for (int64_t j = 0; j < jpad; ++j) {
      float* sj = st + j * kRows + 8 * v;
      __m256 x = _mm256_load_ps(sj);
      if (masked) {
        const __m256 hide = _mm256_castsi256_ps(
            _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(j0 + j)), qp));
        x = _mm256_blendv_ps(x, neg_inf, hide);
        _mm256_store_ps(sj, x);
      }
      mx = _mm256_max_ps(mx, x);
    }
    const __m256 alpha = exp2_ps8(_mm256_sub_ps(old, mx));  // old = -inf (first tile): ~0
    __m256 sum = _mm256_mul_ps(_mm256_load_ps(l + 8 * v), alpha);
    for (int64_t j = 0; j < jpad; ++j) {
      float* sj = st + j * kRows + 8 * v;
      const __m256 x = _mm256_load_ps(sj);
      __m256 p = exp2_ps8(_mm256_sub_ps(x, mx));
      if (masked) p = _mm256_and_ps(p, _mm256_cmp_ps(x, neg_inf, _CMP_NEQ_OQ));
      sum = _mm256_add_ps(sum, p);
      _mm256_store_ps(sj, p);
    }
    _mm256_store_ps(m + 8 * v, mx);
    _mm256_store_ps(l + 8 * v, sum);
    _mm256_store_ps(al + 8 * v, alpha);
  }
}

// D = 32 * DC values per head (64: DC = 2, 128: DC = 4). Float caches are read in place; bf16,
// int8 and fp8 rows are widened (and scaled) into an L1 tile as they are loaded.
template <typename KV, int DC>
void prefill_item_avx2(const float* q, const KV* kc, const KV* vc, const int32_t* table,
                       const PrefillShape& s, int64_t g, int64_t tile, float scale, float* out) {
  constexpr int64_t D = 32 * DC, RS = row_stride<KV>(D);
  constexpr int KB = 4, VB = 3;  // blocks of KB keys (S^T) or values (O^T) x VB row vectors
  const int64_t G = s.G, first = tile * s.QT;  // first query of the tile (chunk index)
  const int64_t npos = std::min(s.QT, s.q_len - first), rows = npos * G;
  const int64_t pos0 = s.ctx_len - s.q_len + first, key_end = pos0 + npos;
  const int nv = static_cast<int>((rows + 7) / 8);  // row vectors holding real rows
  alignas(32) float qt[D * kRows];      // Q^T, scaled by scale * log2(e)
  alignas(32) float st[kKeys * kRows];  // S^T, then P^T
  alignas(32) float ot[D * kRows];      // O^T
  alignas(32) float m[kRows], l[kRows], al[kRows];
  alignas(32) int32_t qpos[kRows];
  alignas(32) float kbuf[std::is_same_v<KV, float> ? 1 : kKeys * D];
  alignas(32) float vbuf[std::is_same_v<KV, float> ? 1 : kKeys * D];
  alignas(32) static const float zero_row[D] = {};
  start_float_item(q, s, g, first, rows, pos0, D, scale, qt, qpos, m, l);
  std::memset(ot, 0, sizeof(ot));
  const float* krow[kKeys];
  const float* vrow[kKeys];
  for (int64_t j0 = 0; j0 < key_end; j0 += kKeys) {
    const int64_t jn = std::min(kKeys, key_end - j0), jpad = (jn + KB - 1) / KB * KB;
    for_each_slot(table, s.block_size, j0, j0 + jn, [&](int64_t t, int64_t slot) {
      const int64_t j = t - j0, off = (slot * s.KVH + g) * RS;
      if constexpr (std::is_same_v<KV, float>) {
        krow[j] = kc + off;
        vrow[j] = vc + off;
      } else {
        const __m256 ks = _mm256_set1_ps(row_scale(kc + off, D)), vs = _mm256_set1_ps(row_scale(vc + off, D));
        for (int64_t c = 0; c < D; c += 8) {
          _mm256_store_ps(kbuf + j * D + c, _mm256_mul_ps(load8(kc + off + c), ks));
          _mm256_store_ps(vbuf + j * D + c, _mm256_mul_ps(load8(vc + off + c), vs));
        }
        krow[j] = kbuf + j * D;
        vrow[j] = vbuf + j * D;
      }
    });
    for (int64_t j = jn; j < jpad; ++j) krow[j] = vrow[j] = zero_row;
    // S^T = K Q^T: KB keys x VB row vectors at a time.
    for (int64_t jb = 0; jb < jpad; jb += KB) {
      for (int v0 = 0; v0 < nv; v0 += VB) {
        __m256 acc[KB][VB];
        for (int jj = 0; jj < KB; ++jj)
          for (int v = 0; v < VB; ++v) acc[jj][v] = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; ++d) {
          __m256 qv[VB];
          for (int v = 0; v < VB; ++v) qv[v] = _mm256_load_ps(qt + d * kRows + 8 * (v0 + v));
          for (int jj = 0; jj < KB; ++jj) {
            const __m256 kb = _mm256_broadcast_ss(krow[jb + jj] + d);
            for (int v = 0; v < VB; ++v) acc[jj][v] = _mm256_fmadd_ps(kb, qv[v], acc[jj][v]);
          }
        }
        for (int jj = 0; jj < KB; ++jj)
          for (int v = 0; v < VB; ++v) _mm256_store_ps(st + (jb + jj) * kRows + 8 * (v0 + v), acc[jj][v]);
      }
    }
    softmax_tile_avx2(st, m, l, al, qpos, j0, jpad, pos0, nv);  // mask, P^T in place, m, l
    // O^T = O^T * alpha + V^T P^T: KB values x VB row vectors at a time (as S^T's blocks, so
    // the 16 registers hold them without spills; a rows-by-values block spilled its values).
    for (int64_t d0 = 0; d0 < D; d0 += KB) {
      for (int v0 = 0; v0 < nv; v0 += VB) {
        __m256 acc[KB][VB];
        for (int v = 0; v < VB; ++v) {
          const __m256 a = _mm256_load_ps(al + 8 * (v0 + v));
          for (int dd = 0; dd < KB; ++dd)
            acc[dd][v] = _mm256_mul_ps(_mm256_load_ps(ot + (d0 + dd) * kRows + 8 * (v0 + v)), a);
        }
        for (int64_t j = 0; j < jn; ++j) {
          __m256 pv[VB];
          for (int v = 0; v < VB; ++v) pv[v] = _mm256_load_ps(st + j * kRows + 8 * (v0 + v));
          for (int dd = 0; dd < KB; ++dd) {
            const __m256 vb = _mm256_broadcast_ss(vrow[j] + d0 + dd);
            for (int v = 0; v < VB; ++v) acc[dd][v] = _mm256_fmadd_ps(vb, pv[v], acc[dd][v]);
          }
        }
        for (int dd = 0; dd < KB; ++dd)
          for (int v = 0; v < VB; ++v) _mm256_store_ps(ot + (d0 + dd) * kRows + 8 * (v0 + v), acc[dd][v]);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* dst = out + ((first + r / G) * s.H + g * G + r % G) * D;
    const float inv = 1.0f / l[r];
    for (int64_t d = 0; d < D; ++d) dst[d] = ot[d * kRows + r] * inv;
  }
}
#endif
