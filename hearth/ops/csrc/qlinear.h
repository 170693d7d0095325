// qlinear: quantized linear layers over ggml blocks (float32 and 8-bit activations).
//
// A fragment of hearth's one kernel build: included by cpu_kernels.cpp inside
// namespace hearth::(anonymous), after the headers listed before it there.

// ---------------------------------------------------------------------------------------------
// qlinear: out[m, n] = sum_k x[m, k] * W[n, k], W in a ggml block format repacked by row:
//
//   qs [N, K/32 * 16] uint8 (Q4_0/Q4_1: block b's 32 nibbles, low nibbles = elements 0..15)
//      or [N, K] int8 (Q8_0)
//   d  [N, K/32] fp16 scale per block;  m [N, K/32] fp16 offset per block (Q4_1; Q4_0: -8 d)
//   w[n, 32 b + j] = d[n, b] * q[n, b, j] + m[n, b]      (exactly ggml's dequantization)
//
// The bytes are ggml's, with the scales moved out of the blocks so a row's scales convert to
// float in a few vector instructions and the block loop is loads, nibble unpacks and FMAs.
// A tile of NR weight rows x MT activation rows keeps NR * MT * 2 accumulators in registers, so
// each unpacked block is used MT times and the FMA chains are independent.

struct QWeight {
  int64_t qtype, N, K, nb;
  const uint8_t* qs;
  const uint16_t* d;
  const uint16_t* m;  // null unless Q4_1
  int64_t qs_row() const { return qtype == kQ8_0 ? K : K / 2; }
};

// The NR rows' scales (and offsets) starting at row n, as float: sd[r * nb + b].
inline void row_scales(const QWeight& w, int64_t n, int NR, float* sd, float* sm) {
  const int64_t count = NR * w.nb;  // the NR rows' scales are contiguous
  const uint16_t* d = w.d + n * w.nb;
  const uint16_t* m = w.m ? w.m + n * w.nb : nullptr;
#if defined(__AVX512F__)
  for (int64_t i = 0; i < count; i += 16) {
    const __mmask16 mask = count - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (count - i)) - 1);
    const __m512 df = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, d + i));
    _mm512_mask_storeu_ps(sd + i, mask, df);
    const __m512 mf = m ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, m + i))
                        : (w.qtype == kQ4_0 ? _mm512_mul_ps(df, _mm512_set1_ps(-8.0f)) : _mm512_setzero_ps());
    _mm512_mask_storeu_ps(sm + i, mask, mf);
  }
#else
  int64_t i = 0;
#if defined(__AVX2__)
  for (; i + 8 <= count; i += 8) {
    const __m256 df = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + i)));
    _mm256_storeu_ps(sd + i, df);
    _mm256_storeu_ps(sm + i, m ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m + i)))
                               : w.qtype == kQ4_0 ? _mm256_mul_ps(df, _mm256_set1_ps(-8.0f))
                                                   : _mm256_setzero_ps());
  }
#endif
  for (; i < count; ++i) {
    sd[i] = _cvtsh_ss(d[i]);
    sm[i] = m ? _cvtsh_ss(m[i]) : (w.qtype == kQ4_0 ? -8.0f * sd[i] : 0.0f);
  }
#endif
}

// The tile asks for the same bytes of the weight rows kAheadRows further on, a cache line per
// line it reads, spread through its block loop. A batch-1 engine step, interleaved A/B: 8.3 ->
// 6.95 ms (batch 4: 12.7 -> 11.3, batch 8: 20.1 -> 19.4) against asking for the rows of the
// group 2 groups ahead all at once when a group starts (a burst of ~40 prefetches that fills
// the line-fill buffers and stalls the loads behind it); 16 rows ahead measured the same.
constexpr int64_t kAheadRows = 8;

#if defined(__AVX512F__)
template <int NR, int MT>
void qlinear_tile(const QWeight& w, int64_t n, const float* sd, const float* sm, const float* x,
                  int64_t ldx, float* out, int64_t ldo) {
  // Q4: a block's 16 possible weights d * j + m (j = 0..15) are one register, and each nibble
  // indexes it (vpermps reads the low 4 bits of each lane): one FMA builds the table, two
  // permutes dequantize 32 weights, two FMAs multiply them, with no integer-to-float conversion.
  // Q8_0: w = d q, scaled once per block after the integer-valued products.
  const int64_t qb = w.qtype == kQ8_0 ? 32 : 16, row = w.qs_row();
  const uint8_t* q0 = w.qs + n * row;
  const bool q8 = w.qtype == kQ8_0;
  // MT <= 2: two accumulators per row, so the two FMAs of a block are not one dependency chain.
  constexpr int NA = MT <= 2 ? 2 : 1;
  __m512 acc[NR][MT][NA];
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < MT; ++i)
      for (int a = 0; a < NA; ++a) acc[r][i][a] = _mm512_setzero_ps();
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const bool ahead = n + NR + kAheadRows <= w.N;
  for (int64_t b = 0; b < w.nb; ++b) {
    if (ahead && (b * qb) % 64 == 0)
      for (int r = 0; r < NR; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(q0 + (r + kAheadRows) * row + b * qb),
                     _MM_HINT_T0);
    __m512 xl[MT], xh[MT];
    for (int i = 0; i < MT; ++i) {
      xl[i] = _mm512_loadu_ps(x + i * ldx + b * kQK);
      xh[i] = _mm512_loadu_ps(x + i * ldx + b * kQK + 16);
    }
    for (int r = 0; r < NR; ++r) {
      const uint8_t* q = q0 + r * row + b * qb;
      const __m512 d = _mm512_set1_ps(sd[r * w.nb + b]);
      if (q8) {
        const __m128i* p = reinterpret_cast<const __m128i*>(q);
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p)));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p + 1)));
        for (int i = 0; i < MT; ++i) {
          const __m512 t = _mm512_fmadd_ps(hi, xh[i], _mm512_mul_ps(lo, xl[i]));
          acc[r][i][0] = _mm512_fmadd_ps(t, d, acc[r][i][0]);
        }
      } else {
        const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
        const __m512 table = _mm512_fmadd_ps(d, iota, _mm512_set1_ps(sm[r * w.nb + b]));
        const __m512 lo = _mm512_permutexvar_ps(bytes, table);
        const __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
        for (int i = 0; i < MT; ++i) {
          acc[r][i][0] = _mm512_fmadd_ps(lo, xl[i], acc[r][i][0]);
          acc[r][i][NA - 1] = _mm512_fmadd_ps(hi, xh[i], acc[r][i][NA - 1]);
        }
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < MT; ++i) {
      __m512 s = acc[r][i][0];
      if constexpr (NA == 2) s = _mm512_add_ps(s, acc[r][i][1]);
      out[i * ldo + r] = _mm512_reduce_add_ps(s);
    }
}
#elif defined(__AVX2__)
// AVX2 + FMA (CPUs without AVX-512): 8 lanes, 16 registers, and no 16-lane permute, so the
// 16-entry table above would cost two vpermps and a blend per 8 weights. Instead each 8 bytes
// widen to 32-bit lanes (vpmovzxbd from memory), split into low and high nibbles, convert to
// float and take one FMA with (d, m): w = d q + m as ggml computes it. Q8_0 as above: w = d q,
// the integer-valued products summed per block and scaled once. x is read from L1 by the FMAs.
// One SmolLM2-135M step's linears (Q4_1 + the Q8_0 LM head) at M = 1, 1 thread, against the
// plain loops below: 48 -> 10.8 ms (the AVX-512 tile: ~11-12 ms on the same machine).
template <int NR, int MT>
void qlinear_tile(const QWeight& w, int64_t n, const float* sd, const float* sm, const float* x,
                  int64_t ldx, float* out, int64_t ldo) {
  const int64_t qb = w.qtype == kQ8_0 ? 32 : 16, row = w.qs_row();
  const uint8_t* q0 = w.qs + n * row;
  const bool q8 = w.qtype == kQ8_0;
  // Two FMA chains per (weight row, x row) when there are few x rows: a Q4 block's 4 FMAs per
  // row would otherwise wait on each other (M = 1: 11.2 -> 10.6 ms; 4 chains measured 11.2).
  constexpr int NA = MT <= 2 ? 2 : 1;
  __m256 acc[NR][MT][NA];
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < MT; ++i)
      for (int a = 0; a < NA; ++a) acc[r][i][a] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi32(0x0F);
  const bool ahead = n + NR + kAheadRows <= w.N;
  for (int64_t b = 0; b < w.nb; ++b) {
    if (ahead && (b * qb) % 64 == 0)
      for (int r = 0; r < NR; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(q0 + (r + kAheadRows) * row + b * qb),
                     _MM_HINT_T0);
    for (int r = 0; r < NR; ++r) {
      const uint8_t* q = q0 + r * row + b * qb;
      const __m256 d = _mm256_set1_ps(sd[r * w.nb + b]);
      if (q8) {
        __m256 wq[4];
        for (int g = 0; g < 4; ++g)
          wq[g] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * g))));
        for (int i = 0; i < MT; ++i) {
          const float* xb = x + i * ldx + b * kQK;
          __m256 t = _mm256_mul_ps(wq[0], _mm256_loadu_ps(xb));
          for (int g = 1; g < 4; ++g) t = _mm256_fmadd_ps(wq[g], _mm256_loadu_ps(xb + 8 * g), t);
          acc[r][i][0] = _mm256_fmadd_ps(t, d, acc[r][i][0]);
        }
      } else {
        // bytes 0-7 hold elements 0-7 (low nibbles) and 16-23 (high), bytes 8-15: 8-15, 24-31
        const __m256 m = _mm256_set1_ps(sm[r * w.nb + b]);
        const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
        const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8)));
        const __m256i nib[4] = {_mm256_and_si256(b0, low4), _mm256_and_si256(b1, low4),
                                _mm256_srli_epi32(b0, 4), _mm256_srli_epi32(b1, 4)};
        for (int g = 0; g < 4; ++g) {
          const __m256 wf = _mm256_fmadd_ps(_mm256_cvtepi32_ps(nib[g]), d, m);
          for (int i = 0; i < MT; ++i)
            acc[r][i][g % NA] = _mm256_fmadd_ps(wf, _mm256_loadu_ps(x + i * ldx + b * kQK + 8 * g),
                                                acc[r][i][g % NA]);
        }
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < MT; ++i) {
      __m256 s = acc[r][i][0];
      for (int a = 1; a < NA; ++a) s = _mm256_add_ps(s, acc[r][i][a]);
      const __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
      const __m128 h2 = _mm_add_ps(h, _mm_movehl_ps(h, h));
      out[i * ldo + r] = _mm_cvtss_f32(_mm_add_ss(h2, _mm_movehdup_ps(h2)));
    }
}
#else
template <int NR, int MT>
void qlinear_tile(const QWeight& w, int64_t n, const float* sd, const float* sm, const float* x,
                  int64_t ldx, float* out, int64_t ldo) {
  const int64_t qb = w.qtype == kQ8_0 ? 32 : 16, row = w.qs_row();
  float acc[NR][MT][8] = {};
  alignas(64) float wf[32];
  for (int64_t b = 0; b < w.nb; ++b) {
    for (int r = 0; r < NR; ++r) {
      const uint8_t* q = w.qs + (n + r) * row + b * qb;
      const float d = sd[r * w.nb + b], m = sm[r * w.nb + b];
      if (w.qtype == kQ8_0) {
        const int8_t* q8 = reinterpret_cast<const int8_t*>(q);
#pragma omp simd
        for (int j = 0; j < 32; ++j) wf[j] = static_cast<float>(q8[j]) * d;
      } else {
#pragma omp simd
        for (int j = 0; j < 16; ++j) {
          wf[j] = static_cast<float>(q[j] & 0xF) * d + m;
          wf[j + 16] = static_cast<float>(q[j] >> 4) * d + m;
        }
      }
      for (int i = 0; i < MT; ++i) {
        const float* xi = x + i * ldx + b * kQK;
        for (int c = 0; c < 4; ++c) {
#pragma omp simd
          for (int j = 0; j < 8; ++j) acc[r][i][j] += wf[c * 8 + j] * xi[c * 8 + j];
        }
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < MT; ++i) {
      float s = 0;
      for (int j = 0; j < 8; ++j) s += acc[r][i][j];
      out[i * ldo + r] = s;
    }
}
#endif

// Ask for the scales (and, with `rows`, the weight rows) of the group `kPrefetchGroups` groups
// of NR rows ahead of row n while this group computes. The hardware prefetcher alone left a
// batch-1 pass over the default model's 96 MB of weights at ~11 GB/s of the machine's ~28 (the
// unpack arithmetic between loads keeps too few misses in flight); with this, the pass took 17%
// less time on 2 threads and 24% less on 1 (interleaved A/B, 25 passes each). The fp32 tiles
// now ask for their rows themselves, spread through the block loop (kAheadRows), which is
// faster still; the int8-activation tiles take the rows from here.
constexpr int64_t kPrefetchGroups = 2;

inline void prefetch_weight_rows(const QWeight& w, int64_t n, int NR, bool rows) {
  const int64_t ahead = n + kPrefetchGroups * NR;
  if (ahead + NR > w.N) return;
  auto fetch = [](const void* p, int64_t bytes) {
    const char* c = static_cast<const char*>(p);
    for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(c + i, _MM_HINT_T0);
  };
  if (rows) fetch(w.qs + ahead * w.qs_row(), NR * w.qs_row());
  fetch(w.d + ahead * w.nb, NR * w.nb * 2);
  if (w.m) fetch(w.m + ahead * w.nb, NR * w.nb * 2);
}

// MT rows of x against the NR weight rows at n, in tiles of 2 weight rows: measured faster
// than tiles of 4 at every row count from 1 to 16 (M = 1 by 7%, M = 4 by 13%; interleaved A/B
// over one step's weights), and MT <= 8 keeps the 2 * MT accumulators in registers. AVX2 has
// 16 registers, not 32: past 4 x rows it takes tiles of 1 weight row (M = 8 over one step's
// weights on 1 thread, interleaved A/B: 36.9 -> 31.7 ms).
template <int NR, int MT>
inline void qlinear_tile_pairs(const QWeight& w, int64_t n, const float* sd, const float* sm,
                               const float* x, float* out) {
#if defined(__AVX2__) && !defined(__AVX512F__)
  constexpr int TR = MT <= 4 ? 2 : 1;
#else
  constexpr int TR = 2;
#endif
  if constexpr (NR % TR == 0) {
    for (int r = 0; r < NR; r += TR)
      qlinear_tile<TR, MT>(w, n + r, sd + r * w.nb, sm + r * w.nb, x, w.K, out + r, w.N);
  } else {
    qlinear_tile<NR, MT>(w, n, sd, sm, x, w.K, out, w.N);
  }
}

template <int NR>
void qlinear_rows(const QWeight& w, int64_t n, const float* x, int64_t M, float* out) {
  thread_local std::vector<float> scales;
  scales.resize(2 * NR * w.nb);
  float* sd = scales.data();
  float* sm = sd + NR * w.nb;
  row_scales(w, n, NR, sd, sm);
#if defined(__AVX512F__) || defined(__AVX2__)
  prefetch_weight_rows(w, n, NR, /*rows=*/false);  // the tiles ask for the rows (kAheadRows)
#else
  prefetch_weight_rows(w, n, NR, /*rows=*/true);
#endif
  // Up to 8 activation rows share each unpacked block, and a step's rows are read in as few
  // tiles as possible: a 2-token verify step unpacks W once, not twice (with tiles of 1 or 4
  // rows only, M = 2, 3, 5-7 ran one tile per leftover row: M = 7 cost 1.9x M = 4).
  int64_t i = 0;
  for (; i + 8 <= M; i += 8)
    qlinear_tile_pairs<NR, 8>(w, n, sd, sm, x + i * w.K, out + i * w.N + n);
  const float* xi = x + i * w.K;
  float* oi = out + i * w.N + n;
  switch (M - i) {
    case 7: qlinear_tile_pairs<NR, 7>(w, n, sd, sm, xi, oi); break;
    case 6: qlinear_tile_pairs<NR, 6>(w, n, sd, sm, xi, oi); break;
    case 5: qlinear_tile_pairs<NR, 5>(w, n, sd, sm, xi, oi); break;
    case 4: qlinear_tile_pairs<NR, 4>(w, n, sd, sm, xi, oi); break;
    case 3: qlinear_tile_pairs<NR, 3>(w, n, sd, sm, xi, oi); break;
    case 2: qlinear_tile_pairs<NR, 2>(w, n, sd, sm, xi, oi); break;
    case 1: qlinear_tile_pairs<NR, 1>(w, n, sd, sm, xi, oi); break;
    default: break;
  }
}

// ---------------------------------------------------------------------------------------------
// qlinear with 8-bit activations (llama.cpp's way for a decode step): each 32-element block of a
// row of x is quantized to int8 with its own float scale (dx = max|x| / 127, qx = round(x / dx)),
// and a block's dot product is an integer sum:
//   sum_j (d q_j + m) (dx qx_j) = d dx sum_j q_j qx_j + m dx sum_j qx_j.
// With AVX512-VNNI one `vpdpbusd` multiplies 64 unsigned by 64 signed bytes and sums them in
// groups of 4: a 64-byte register covers two blocks (lanes 0-7 block 2p, 8-15 block 2p + 1).
// Q4 nibbles are the unsigned operand; for Q8_0 (signed weights) the activations are the
// unsigned one, offset by 128, and 128 * sum(q) is subtracted. Without VNNI the same integer sums
// run in plain loops, so every build computes the same numbers (up to float summation order).

// How a call lays out its quantized activations: the order the weight loop reads them in.
enum ActLayout {
  kNatural = 0,   // int8, row order (the plain loops)
  kOffset = 1,    // uint8 qx + 128, row order (VNNI x Q8_0: the activations are the unsigned side)
  kQ4Quads = 2,   // int8, per 4 blocks: their first halves (elements 0-15), then their second
                  // halves: the order of a 64-byte load of 4 Q4 blocks split into low and high nibbles
};

struct QAct {
  int64_t M, nb, stride;  // stride: bytes per row of q
  const int8_t* q;
  const float* dx;   // [M, nb] block scales
  const float* xs;   // [M, nb] dx * sum(qx) of each block (the offset terms)
  const float* dxe;  // [M, groups, 16] each block's dx spread over the lanes its dot product fills
};

inline int64_t act_group(int layout) { return layout == kQ4Quads ? 4 : 2; }  // blocks per register
inline int64_t act_stride(int layout, int64_t nb) {
  return layout == kQ4Quads ? (nb + 3) / 4 * 128 : nb * kQK;
}

void quantize_rows(const float* x, int64_t M, int64_t K, int layout, int8_t* q, float* dx,
                   float* xs, float* dxe) {
  const int64_t nb = K / kQK, G = act_group(layout), ng = (nb + G - 1) / G, lanes = 16 / G;
  const int64_t stride = act_stride(layout, nb);
  std::memset(q, 0, M * stride);
  std::fill(dxe, dxe + M * ng * 16, 0.0f);
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + i * K + b * kQK;
      float amax = 0;
      for (int j = 0; j < kQK; ++j) amax = std::max(amax, std::fabs(xb[j]));
      const float d = amax / 127.0f, inv = amax > 0 ? 127.0f / amax : 0.0f;
      int32_t sum = 0;
      for (int j = 0; j < kQK; ++j) {
        const int32_t v = static_cast<int32_t>(std::nearbyint(xb[j] * inv));
        sum += v;
        if (layout == kQ4Quads)
          q[i * stride + (b / 4) * 128 + (j / 16) * 64 + (b % 4) * 16 + j % 16] = static_cast<int8_t>(v);
        else if (layout == kOffset)
          q[i * stride + b * kQK + j] = static_cast<int8_t>(static_cast<uint8_t>(v + 128));
        else
          q[i * stride + b * kQK + j] = static_cast<int8_t>(v);
      }
      dx[i * nb + b] = d;
      xs[i * nb + b] = d * static_cast<float>(sum);
      for (int64_t l = 0; l < lanes; ++l) dxe[(i * ng + b / G) * 16 + (b % G) * lanes + l] = d;
    }
  }
}

#if defined(__AVX512VNNI__)
// Q4_0/Q4_1 weights: 4 blocks (64 bytes) per load, low and high nibbles against the two halves
// of the quad-ordered activations; lane l of the sum belongs to block l / 4.
template <int NR, int MT>
void qlinear_tile_i8(const QWeight& w, int64_t n, const float* sd, const float* sm, const QAct& a,
                     int64_t i0, float* out, int64_t ldo) {
  const int64_t nb = w.nb;
  __m512 acc[NR][MT];
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < MT; ++i) acc[r][i] = _mm512_setzero_ps();
  if (w.qtype == kQ8_0) {
    // Q8_0: 2 blocks (64 bytes) per load; activations offset by 128 (unsigned), so subtract
    // 128 * sum(q) per block; lane l belongs to block l / 8.
    const uint8_t* q0 = w.qs + n * w.K;
    const __m512i ones = _mm512_set1_epi8(1);
    const __m512i pair_idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const int64_t np = (nb + 1) / 2;
    for (int64_t p = 0; p < np; ++p) {
      const bool full = 2 * p + 1 < nb;
      __m512i xv[MT];
      __m512 dxv[MT];
      for (int i = 0; i < MT; ++i) {
        const int8_t* xp = a.q + (i0 + i) * a.stride + p * 64;
        xv[i] = full ? _mm512_loadu_si512(xp) : _mm512_maskz_loadu_epi8(0xFFFFFFFFull, xp);
        dxv[i] = _mm512_loadu_ps(a.dxe + ((i0 + i) * np + p) * 16);
      }
      for (int r = 0; r < NR; ++r) {
        const float* sdr = sd + r * nb + 2 * p;
        const __m512 dw = _mm512_permutexvar_ps(
            pair_idx, _mm512_castps128_ps512(_mm_maskz_loadu_ps(full ? 3 : 1, sdr)));
        const uint8_t* qp = q0 + r * w.K + p * 64;
        const __m512i wv = full ? _mm512_loadu_si512(qp) : _mm512_maskz_loadu_epi8(0xFFFFFFFFull, qp);
        const __m512i wsum = _mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, wv), 7);
        for (int i = 0; i < MT; ++i) {
          const __m512i s = _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), xv[i], wv), wsum);
          acc[r][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw, dxv[i]), acc[r][i]);
        }
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int i = 0; i < MT; ++i) out[i * ldo + r] = _mm512_reduce_add_ps(acc[r][i]);
    return;
  }
  const uint8_t* q0 = w.qs + n * (w.K / 2);
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512i quad_idx = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  const int64_t nq = (nb + 3) / 4;
  for (int64_t c = 0; c < nq; ++c) {
    const int64_t rem = std::min<int64_t>(4, nb - 4 * c);
    __m512i xlo[MT], xhi[MT];
    __m512 dxv[MT];
    for (int i = 0; i < MT; ++i) {
      const int8_t* xp = a.q + (i0 + i) * a.stride + c * 128;
      xlo[i] = _mm512_loadu_si512(xp);
      xhi[i] = _mm512_loadu_si512(xp + 64);
      dxv[i] = _mm512_loadu_ps(a.dxe + ((i0 + i) * nq + c) * 16);
    }
    for (int r = 0; r < NR; ++r) {
      const uint8_t* qp = q0 + r * (w.K / 2) + c * 64;
      const __m512i wb = rem == 4 ? _mm512_loadu_si512(qp)
                                  : _mm512_maskz_loadu_epi8((1ull << (16 * rem)) - 1, qp);
      const __m512i lo = _mm512_and_si512(wb, low4);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(wb, 4), low4);
      const __m512 dw = _mm512_permutexvar_ps(
          quad_idx, _mm512_castps128_ps512(_mm_maskz_loadu_ps((1u << rem) - 1, sd + r * nb + 4 * c)));
      for (int i = 0; i < MT; ++i) {
        const __m512i s = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xlo[i]), hi, xhi[i]);
        acc[r][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw, dxv[i]), acc[r][i]);
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < MT; ++i) {
      const float* smr = sm + r * nb;
      const float* xs = a.xs + (i0 + i) * nb;
      float m = 0;
#pragma omp simd reduction(+ : m)
      for (int64_t b = 0; b < nb; ++b) m += smr[b] * xs[b];
      out[i * ldo + r] = _mm512_reduce_add_ps(acc[r][i]) + m;
    }
}
#else
template <int NR, int MT>
void qlinear_tile_i8(const QWeight& w, int64_t n, const float* sd, const float* sm, const QAct& a,
                     int64_t i0, float* out, int64_t ldo) {
  const bool q8 = w.qtype == kQ8_0;
  const int64_t row = w.qs_row(), K = w.K, nb = w.nb;
  float acc[NR][MT] = {};
  for (int64_t b = 0; b < nb; ++b) {
    for (int r = 0; r < NR; ++r) {
      const uint8_t* q = w.qs + (n + r) * row + b * (q8 ? 32 : 16);
      const float d = sd[r * nb + b], m = sm[r * nb + b];
      for (int i = 0; i < MT; ++i) {
        const int8_t* x = a.q + (i0 + i) * a.stride + b * kQK;
        int32_t s = 0;
        if (q8) {
          const int8_t* q8p = reinterpret_cast<const int8_t*>(q);
#pragma omp simd reduction(+ : s)
          for (int j = 0; j < 32; ++j) s += static_cast<int32_t>(q8p[j]) * x[j];
        } else {
#pragma omp simd reduction(+ : s)
          for (int j = 0; j < 16; ++j)
            s += static_cast<int32_t>(q[j] & 0xF) * x[j] + static_cast<int32_t>(q[j] >> 4) * x[j + 16];
        }
        acc[r][i] += static_cast<float>(s) * (d * a.dx[(i0 + i) * nb + b]);
        if (!q8) acc[r][i] += m * a.xs[(i0 + i) * nb + b];
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < MT; ++i) out[i * ldo + r] = acc[r][i];
}
#endif

template <int NR>
void qlinear_rows_i8(const QWeight& w, int64_t n, const QAct& a, float* out) {
  thread_local std::vector<float> scales;
  scales.resize(2 * NR * w.nb);
  float* sd = scales.data();
  float* sm = sd + NR * w.nb;
  row_scales(w, n, NR, sd, sm);
  prefetch_weight_rows(w, n, NR, /*rows=*/true);
  int64_t i = 0;
  for (; i + 4 <= a.M; i += 4) qlinear_tile_i8<NR, 4>(w, n, sd, sm, a, i, out + i * w.N + n, w.N);
  for (; i < a.M; ++i) qlinear_tile_i8<NR, 1>(w, n, sd, sm, a, i, out + i * w.N + n, w.N);
}

// Whether this build's int8 path uses VNNI dot products (for the loader's report).
bool has_vnni() {
#if defined(__AVX512VNNI__)
  return true;
#else
  return false;
#endif
}

// Rows of x [M, K] quantized to 8 bits per 32-block in the layout `qtype` weights read (the
// int8-activation path of qlinear and moe_experts); `dxe_row` receives the per-row stride of
// a.dxe (to address a block of rows).
QAct quantize_act(const float* x, int64_t M, int64_t K, int64_t qtype, std::vector<int8_t>& q,
                  std::vector<float>& sc, int64_t& dxe_row) {
  const int layout = !has_vnni() ? kNatural : qtype == kQ8_0 ? kOffset : kQ4Quads;
  const int64_t nb = K / kQK, stride = act_stride(layout, nb), G = act_group(layout);
  dxe_row = (nb + G - 1) / G * 16;
  q.resize(M * stride);
  sc.resize(M * nb * 2 + M * dxe_row);
  float* dx = sc.data();
  quantize_rows(x, M, K, layout, q.data(), dx, dx + M * nb, dx + 2 * M * nb);
  return QAct{M, nb, stride, q.data(), dx, dx + M * nb, dx + 2 * M * nb};
}

// The repacked ggml weight `[N, K]` (qs, d, m as hearth.ops.cpu_kernels.pack_ggml lays them
// out), checked; errors start with `what` (the op, and which weight).
QWeight packed_weight(const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m,
                      int64_t qtype, int64_t N, int64_t K, const char* what) {
  TORCH_CHECK(qtype == kQ4_0 || qtype == kQ4_1 || qtype == kQ8_0, what,
              ": unsupported ggml type ", qtype);
  TORCH_CHECK(K % kQK == 0, what, ": in_features must be a multiple of 32");
  const int64_t nb = K / kQK, qs_row = qtype == kQ8_0 ? K : K / 2;
  TORCH_CHECK(qs.scalar_type() == at::kByte && qs.is_contiguous() && qs.numel() == N * qs_row,
              what, ": qs does not match the repacked ggml layout");
  TORCH_CHECK(d.scalar_type() == at::kHalf && d.is_contiguous() && d.numel() == N * nb, what,
              ": d must be float16 [N, K/32]");
  TORCH_CHECK(qtype != kQ4_1 || (m.scalar_type() == at::kHalf && m.is_contiguous() &&
                                 m.numel() == N * nb),
              what, ": Q4_1 needs m float16 [N, K/32]");
  return QWeight{qtype, N, K, nb, qs.data_ptr<uint8_t>(),
                 reinterpret_cast<const uint16_t*>(d.data_ptr()),
                 qtype == kQ4_1 ? reinterpret_cast<const uint16_t*>(m.data_ptr()) : nullptr};
}

at::Tensor qlinear(const at::Tensor& x_in, const at::Tensor& qs, const at::Tensor& d,
                   const at::Tensor& m, int64_t qtype, int64_t out_features, int64_t in_features,
                   int64_t threads, bool int8_act) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat, "qlinear: activations must be float32");
  const QWeight w = packed_weight(qs, d, m, qtype, out_features, in_features, "qlinear");
  TORCH_CHECK(x_in.size(-1) == in_features, "qlinear: last dim of x must be in_features");
  const int64_t nb = w.nb, N = out_features;
  at::Tensor x = x_in.reshape({-1, in_features}).contiguous();
  const int64_t M = x.size(0);
  auto out_shape = x_in.sizes().vec();
  out_shape.back() = N;
  at::Tensor out = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  constexpr int64_t NR = 4, kGroupsPerTask = 16;  // a task: 64 weight rows
  const int64_t num_groups = N / NR;
  if (int8_act) {
    thread_local std::vector<int8_t> qx;
    thread_local std::vector<float> sc;
    int64_t dxe_row = 0;
    const QAct a = quantize_act(xp, M, in_features, qtype, qx, sc, dxe_row);
    parallel_tasks((num_groups + kGroupsPerTask - 1) / kGroupsPerTask, [&](int64_t task) {
      const int64_t g1 = std::min(num_groups, (task + 1) * kGroupsPerTask);
      for (int64_t g = task * kGroupsPerTask; g < g1; ++g) qlinear_rows_i8<NR>(w, g * NR, a, op);
    }, threads);
    for (int64_t n = num_groups * NR; n < N; ++n) qlinear_rows_i8<1>(w, n, a, op);
    return out.view(out_shape);
  }
  parallel_tasks((num_groups + kGroupsPerTask - 1) / kGroupsPerTask, [&](int64_t task) {
    const int64_t g1 = std::min(num_groups, (task + 1) * kGroupsPerTask);
    for (int64_t g = task * kGroupsPerTask; g < g1; ++g) qlinear_rows<NR>(w, g * NR, xp, M, op);
  }, threads);
  for (int64_t n = num_groups * NR; n < N; ++n) qlinear_rows<1>(w, n, xp, M, op);
  return out.view(out_shape);
}
