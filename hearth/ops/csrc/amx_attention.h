// Prefill attention on AMX tiles (the avx512amx build only).
//
// A fragment of hearth's one kernel build: included by cpu_kernels.cpp inside
// namespace hearth::(anonymous), after the headers listed before it there.

// ---------------------------------------------------------------------------------------------
// Prefill attention on AMX tiles (the avx512amx build only): a prompt chunk in bfloat16, causal
// after any cached prefix, over the paged cache (float32 or bfloat16) read once per kv head into
// bf16 tile layouts. Head dim 64 only (the tiles below are laid out for it); the caller uses
// torch's flash kernel elsewhere. Everything is computed transposed, so that the softmax runs
// down columns (one vector = one key's scores for 16 queries: max, exp and sum are vertical, no
// horizontal reductions) and the rescale of O is one vector multiply per row:
//
//   per kv head g:  Kp  [keys/16][16][64]        A tiles of K: key rows as they are, in bf16
//                   Vt  [keys/32][4][16][32]     A tiles of V^T: tile (b, dc) row r holds dim
//                                                 dc*16 + r of keys b*32 .. +31
//   per work item (query head h, block of 16 query rows):
//                   Qt  [2][16][16][2]           B tiles of Q^T (VNNI pairs of dims)
//   for each 32-key block up to the causal limit:  S^T [32 keys][16 q] = K Q^T (4 tile
//   products, 2 accumulators); online softmax in fp32; P^T packed as a B tile (VNNI pairs of
//   keys); O^T [64][16] += V^T P^T (4 accumulators that stay in tiles across blocks, written
//   out and rescaled only when some query's running max moved).
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)

constexpr int64_t kAmxD = 64;

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The kernel grants a process the AMX tile state only on request (Linux >= 5.16).
bool amx_permitted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

void amx_configure() {
  TileConfig cfg;
  for (int i = 0; i < 8; ++i) {
    cfg.colsb[i] = 64;
    cfg.rows[i] = 16;
  }
  _tile_loadconfig(&cfg);
}

// Transposes the 32 x 32 bf16 matrix in r (row i = r[i]) in place: at each scale s, the
// off-diagonal s x s blocks of every 2s x 2s block swap (rows a and a + s, a's bit s clear),
// one two-source word permute per row.
struct alignas(64) TransposeIndices {
  uint16_t a[5][32], b[5][32];  // per scale 16, 8, 4, 2, 1: the permutes of rows a and a + s
};

inline const TransposeIndices& transpose_indices() {
  static const TransposeIndices idx = [] {
    TransposeIndices t;
    for (int level = 0, s = 16; s >= 1; ++level, s /= 2)
      for (int j = 0; j < 32; ++j) {
        t.a[level][j] = static_cast<uint16_t>(j & s ? 32 + j - s : j);  // b's left block moves in
        t.b[level][j] = static_cast<uint16_t>(j & s ? 32 + j : j + s);  // a's right block moves in
      }
    return t;
  }();
  return idx;
}

inline void transpose32x32_epi16(__m512i* r) {
  const TransposeIndices& idx = transpose_indices();
  for (int level = 0, s = 16; s >= 1; ++level, s /= 2) {
    const __m512i xa = _mm512_load_si512(idx.a[level]), xb = _mm512_load_si512(idx.b[level]);
    for (int a = 0; a < 32; ++a) {
      if (a & s) continue;
      const __m512i lo = r[a], hi = r[a + s];
      r[a] = _mm512_permutex2var_epi16(lo, xa, hi);
      r[a + s] = _mm512_permutex2var_epi16(lo, xb, hi);
    }
  }
}

// Groups [kb0, kb1) of 32 keys of kv head g into Kp (key rows in bf16) and Vt (per group, dim d's
// 32 keys at row d: [64][32], which is the 4 A tiles [dc][16][32]); keys past ctx are zero (masked
// by the causal limit; zero so that 0 * V stays 0).
template <typename KV>
void amx_pack_kv(const KV* kc, const KV* vc, const int32_t* table, int64_t block_size,
                 int64_t KVH, int64_t g, int64_t ctx, int64_t kb0, int64_t kb1, uint16_t* kp,
                 uint16_t* vt) {
  for (int64_t b = kb0; b < kb1; ++b) {
    const int64_t t0 = b * 32, n = std::clamp<int64_t>(ctx - t0, 0, 32);
    const KV* krow[32];
    const KV* vrow[32];
    for_each_slot(table, block_size, t0, t0 + n, [&](int64_t t, int64_t slot) {
      krow[t - t0] = kc + (slot * KVH + g) * kAmxD;
      vrow[t - t0] = vc + (slot * KVH + g) * kAmxD;
    });
    uint16_t* kg = kp + t0 * kAmxD;
    uint16_t* vg = vt + t0 * kAmxD;
    if constexpr (std::is_same_v<KV, uint16_t>) {  // a bf16 cache: rows as stored
      __m512i lo[32], hi[32];
      for (int64_t i = 0; i < 32; ++i) {
        if (i < n) {
          lo[i] = _mm512_loadu_si512(krow[i]);
          hi[i] = _mm512_loadu_si512(krow[i] + 32);
        } else {
          lo[i] = hi[i] = _mm512_setzero_si512();
        }
        _mm512_storeu_si512(kg + i * kAmxD, lo[i]);
        _mm512_storeu_si512(kg + i * kAmxD + 32, hi[i]);
      }
      for (int64_t i = 0; i < 32; ++i) {
        lo[i] = i < n ? _mm512_loadu_si512(vrow[i]) : _mm512_setzero_si512();
        hi[i] = i < n ? _mm512_loadu_si512(vrow[i] + 32) : _mm512_setzero_si512();
      }
      transpose32x32_epi16(lo);
      transpose32x32_epi16(hi);
      for (int64_t d = 0; d < 32; ++d) {
        _mm512_storeu_si512(vg + d * 32, lo[d]);
        _mm512_storeu_si512(vg + (32 + d) * 32, hi[d]);
      }
    } else {
      for (int64_t i = 0; i < 32; ++i)
        for (int64_t d = 0; d < kAmxD; ++d) {
          kg[i * kAmxD + d] = i < n ? float_to_bf16(load_kv(krow[i], d)) : 0;
          vg[d * 32 + i] = i < n ? float_to_bf16(load_kv(vrow[i], d)) : 0;
        }
    }
  }
}

// 2^x for x <= 0 feeding bf16 probabilities: a degree-4 polynomial on [-0.5, 0.5] fitted for
// relative error (2.7e-6; the degree-5 Taylor one before cost an FMA more on every score, and a
// degree-3 fit, 7.7e-5, moved the teacher-forced KL against fp32 from 6.2e-4 to 6.9e-4); very
// negative x underflows to 0 through scalef.
inline __m512 exp2_short_ps(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(0.009560519830953755f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.055917122821504475f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24024981650208507f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931219575521046f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.9999991904524186f));
  return _mm512_scalef_ps(p, n);
}

inline void amx_scores(const uint16_t* k0, const uint32_t* qt) {  // tiles 0, 1 = S^T of 32 keys
  _tile_zero(0);
  _tile_zero(1);
  for (int c = 0; c < 2; ++c) {  // tile numbers are immediates; the pointers vary
    _tile_loadd(3, qt + c * 256, 64);
    _tile_loadd(2, k0 + c * 32, kAmxD * 2);
    _tile_dpbf16ps(0, 2, 3);
    _tile_loadd(2, k0 + 16 * kAmxD + c * 32, kAmxD * 2);
    _tile_dpbf16ps(1, 2, 3);
  }
}

inline void amx_store_o(float* ot) {  // the O^T accumulators (tiles 4-7) to [64][16] floats
  _tile_stored(4, ot, 64);
  _tile_stored(5, ot + 256, 64);
  _tile_stored(6, ot + 512, 64);
  _tile_stored(7, ot + 768, 64);
}

// Query rows [i0, i0 + 16) of head h (row i at position off + i), over the packed K/V of its kv
// head; writes the valid rows of out (bf16). Tiles: 0, 1 S^T accumulators; 2 A operand; 3 B
// operand; 4-7 O^T accumulators.
void amx_attend_block(const uint16_t* q, int64_t q_stride, int64_t q_len, int64_t off, int64_t i0,
                      const uint16_t* kp, const uint16_t* vt, float scale, uint16_t* out,
                      int64_t out_stride) {
  alignas(64) uint32_t qt[2 * 16 * 16];  // VNNI pairs of dims: [chunk][pair][query]
  alignas(64) float st[32 * 16];         // S^T, one row per key
  alignas(64) uint16_t pt[16 * 32];      // P^T as a B tile: [key pair][query][2]
  alignas(64) float ot[kAmxD * 16];      // O^T
  const int64_t rows = std::min<int64_t>(16, q_len - i0);
  std::memset(qt, 0, sizeof(qt));
  for (int64_t r = 0; r < rows; ++r) {
    const uint32_t* qr = reinterpret_cast<const uint32_t*>(q + (i0 + r) * q_stride);
    for (int64_t p = 0; p < kAmxD / 2; ++p) qt[p * 16 + r] = qr[p];  // pair p: chunk p/16, row p%16
  }
  const __m512 vscale = _mm512_set1_ps(scale * kLog2e), ninf = _mm512_set1_ps(-INFINITY);
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                              24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17,
                                              1, 16, 0);
  __m512 m = ninf, l = _mm512_setzero_ps();
  const int64_t first_pos = off + i0, last_pos = off + i0 + rows - 1;
  const int64_t nkb = last_pos / 32 + 1;
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  // S^T of block b + 1 is issued before block b's softmax, so the tile unit computes it while
  // the vector units work (the two would otherwise wait on each other every block).
  amx_scores(kp, qt);
  for (int64_t b = 0; b < nkb; ++b) {
    _tile_stored(0, st, 64);
    _tile_stored(1, st + 256, 64);
    if (b + 1 < nkb) amx_scores(kp + (b + 1) * 32 * kAmxD, qt);
    // Key j of the block is visible to query lanes >= b*32 + j - first_pos. The max runs over
    // raw scores (scale > 0 keeps their order); the scale joins the exponent's one FMA.
    const bool diagonal = b * 32 + 31 > first_pos;
    __mmask16 vis[32];
    __m512 raw_max = _mm512_set1_ps(-INFINITY);
    if (diagonal) {
      for (int j = 0; j < 32; ++j) {
        const int64_t t = b * 32 + j - first_pos;
        vis[j] = t <= 0 ? 0xffff : t >= 16 ? 0 : static_cast<__mmask16>(0xffffu << t);
        raw_max = _mm512_mask_max_ps(raw_max, vis[j], raw_max, _mm512_load_ps(st + j * 16));
      }
    } else {  // every key of the block visible to every query (the prefix, most blocks)
      for (int j = 0; j < 32; ++j) vis[j] = 0xffff;
      for (int j = 0; j < 32; j += 2)
        raw_max = _mm512_max_ps(raw_max, _mm512_max_ps(_mm512_load_ps(st + j * 16),
                                                       _mm512_load_ps(st + (j + 1) * 16)));
    }
    // Block 0 always holds key 0, which every query sees: mx is finite from here on.
    const __m512 mx = _mm512_max_ps(m, _mm512_mul_ps(raw_max, vscale));
    __m512 sum = _mm512_setzero_ps();
    for (int j = 0; j < 32; j += 2) {
      const __m512 e0 = _mm512_maskz_mov_ps(
          vis[j], exp2_short_ps(_mm512_fmsub_ps(_mm512_load_ps(st + j * 16), vscale, mx)));
      const __m512 e1 = _mm512_maskz_mov_ps(
          vis[j + 1], exp2_short_ps(_mm512_fmsub_ps(_mm512_load_ps(st + (j + 1) * 16), vscale, mx)));
      sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
      const __m512i packed = (__m512i)_mm512_cvtne2ps_pbh(e1, e0);  // [e0 x16, e1 x16]
      _mm512_store_si512(pt + j * 16, _mm512_permutexvar_epi16(interleave, packed));
    }
    if (_mm512_cmp_ps_mask(mx, m, _CMP_NEQ_OQ)) {  // some running max moved: rescale O^T
      const __m512 alpha = exp2_ps(_mm512_sub_ps(m, mx));  // m = -inf: ~0, and O^T is 0
      l = _mm512_mul_ps(l, alpha);
      if (b > 0) {
        amx_store_o(ot);
        for (int64_t d = 0; d < kAmxD; ++d)
          _mm512_store_ps(ot + d * 16, _mm512_mul_ps(_mm512_load_ps(ot + d * 16), alpha));
        _tile_loadd(4, ot, 64);
        _tile_loadd(5, ot + 256, 64);
        _tile_loadd(6, ot + 512, 64);
        _tile_loadd(7, ot + 768, 64);
      }
      m = mx;
    }
    l = _mm512_add_ps(l, sum);
    _tile_loadd(3, pt, 64);
    const uint16_t* v0 = vt + b * 32 * kAmxD;
    _tile_loadd(2, v0, 64);
    _tile_dpbf16ps(4, 2, 3);
    _tile_loadd(2, v0 + 512, 64);
    _tile_dpbf16ps(5, 2, 3);
    _tile_loadd(2, v0 + 1024, 64);
    _tile_dpbf16ps(6, 2, 3);
    _tile_loadd(2, v0 + 1536, 64);
    _tile_dpbf16ps(7, 2, 3);
  }
  amx_store_o(ot);
  alignas(64) float inv[16];
  _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), l));
  for (int64_t r = 0; r < rows; ++r) {
    uint16_t* dst = out + (i0 + r) * out_stride;
    for (int64_t d = 0; d < kAmxD; ++d) dst[d] = float_to_bf16(ot[d * 16 + r] * inv[r]);
  }
}

bool amx_attention_usable() { return amx_permitted(); }

// q [q_len, H, 64] bfloat16 (rows may be strided: a view of the qkv projection); caches
// [num_blocks, block_size, KVH, 64] float32 or bfloat16 holding the chunk's own K/V already.
// Returns [q_len, H, 64] bfloat16.
at::Tensor amx_prefill_attention(const at::Tensor& q_in, const at::Tensor& k_cache,
                                 const at::Tensor& v_cache, const at::Tensor& block_table_in,
                                 int64_t ctx_len, double scale, int64_t threads) {
  TORCH_CHECK(amx_permitted(), "amx_prefill_attention: this process may not use AMX tiles");
  TORCH_CHECK(q_in.scalar_type() == at::kBFloat16 && q_in.dim() == 3 && q_in.size(2) == kAmxD,
              "amx_prefill_attention: q bfloat16 [T, H, 64]");
  at::Tensor q = q_in.stride(2) == 1 && q_in.stride(1) == kAmxD ? q_in : q_in.contiguous();
  at::Tensor table = check_chunk_over_cache("amx_prefill_attention", q.size(0), k_cache, v_cache,
                                            block_table_in, ctx_len);
  const bool bf16 = is_bf16(k_cache);
  TORCH_CHECK(bf16 || k_cache.scalar_type() == at::kFloat, "amx_prefill_attention: cache dtype");
  const int64_t T = q.size(0), H = q.size(1), KVH = k_cache.size(2), bs = k_cache.size(1);
  TORCH_CHECK(KVH >= 1 && H % KVH == 0 && k_cache.size(3) == kAmxD,
              "amx_prefill_attention: head shapes (head dim 64)");
  const int32_t* tp = table.data_ptr<int32_t>();
  const int64_t G = H / KVH, nkb32 = (ctx_len + 31) / 32, off = ctx_len - T;
  const int64_t per_head = nkb32 * 32 * kAmxD;  // uint16 elements (K and V alike)
  // Packed per call (each layer has its own cache), every element written (no zero fill first),
  // in tasks of kPackGroups groups of 32 keys so that 3 kv heads keep 2 threads busy.
  constexpr int64_t kPackGroups = 16;
  at::Tensor packed = at::empty({2 * KVH * per_head}, q.options());
  uint16_t* kbuf = reinterpret_cast<uint16_t*>(packed.data_ptr());
  uint16_t* vbuf = kbuf + KVH * per_head;
  const int64_t pack_tasks = (nkb32 + kPackGroups - 1) / kPackGroups;
  parallel_tasks(KVH * pack_tasks, [&](int64_t item) {
    const int64_t g = item / pack_tasks, kb0 = item % pack_tasks * kPackGroups;
    const int64_t kb1 = std::min(nkb32, kb0 + kPackGroups);
    if (bf16)
      amx_pack_kv(reinterpret_cast<const uint16_t*>(k_cache.data_ptr()),
                  reinterpret_cast<const uint16_t*>(v_cache.data_ptr()), tp, bs, KVH, g, ctx_len,
                  kb0, kb1, kbuf + g * per_head, vbuf + g * per_head);
    else
      amx_pack_kv(k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), tp, bs, KVH, g, ctx_len,
                  kb0, kb1, kbuf + g * per_head, vbuf + g * per_head);
  }, threads);
  at::Tensor out = at::empty({T, H, kAmxD}, q.options().memory_format(at::MemoryFormat::Contiguous));
  const uint16_t* qp = reinterpret_cast<const uint16_t*>(q.data_ptr());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t nqb = (T + 15) / 16, q_stride = q.stride(0);
  const float sc = static_cast<float>(scale);
  parallel_tasks(nqb * H, [&](int64_t item) {
    // Last query blocks first: they see the most keys, so the tail of the queue is short work.
    const int64_t qb = nqb - 1 - item / H, h = item % H, g = h / G;
    amx_configure();  // per task: oneDNN's GEMMs load their own tile shapes on these threads
    amx_attend_block(qp + h * kAmxD, q_stride, T, off, qb * 16, kbuf + g * per_head,
                     vbuf + g * per_head, sc, op + h * kAmxD, H * kAmxD);
    _tile_release();
  }, threads);
  return out;
}

#else

bool amx_attention_usable() { return false; }

at::Tensor amx_prefill_attention(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const at::Tensor&, int64_t, double, int64_t) {
  TORCH_CHECK(false, "amx_prefill_attention: not in this build (the avx512amx build has it)");
}

#endif
