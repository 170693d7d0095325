// qlinear: quantized linear layers over ggml blocks with float32 activations (exact), and the
// repacked weight every quantized path reads; qlinear_a8.h and kquant_gemm.h hold the
// 8-bit-activation paths, qlinear_op.h the op over both.
//
// A fragment of hearth's one kernel build: included by cpu_kernels.cpp inside
// namespace hearth::(anonymous), after the headers listed before it there.

// ---------------------------------------------------------------------------------------------
// qlinear: out[m, n] = sum_k x[m, k] * W[n, k], W in a ggml block format repacked by row:
//
//   qs [N, K/32 * 16] uint8 (Q4_0/Q4_1/Q4_K: block b's 32 nibbles, low nibbles = elements
//      0..15) or [N, K] int8 (Q8_0)
//   d  [N, K/32] fp16 scale per block;  m [N, K/32] fp16 offset per block (Q4_1; Q4_0: -8 d)
//   w[n, 32 b + j] = d[n, b] * q[n, b, j] + m[n, b]      (exactly ggml's dequantization)
//
// Q4_K (the blocks of Q4_K_M / Q4_K_S files) keeps its super-block form, so it costs 4.625
// bits per weight (the file's 4.5 plus the 6-bit scales widened to bytes):
//   d  [N, K/256, 2] fp16: each super-block's (d, dmin)
//   m  [N, K/256, 2, 8] uint8: each super-block's eight 6-bit scales, then its eight mins,
//      unpacked from the 12 bytes
//   w[n, 32 b + j] = (d sc) q - dmin mn,  the super-block s = b / 8
// row_scales turns (d, sc) into the block's scale d sc and (dmin, mn) into its offset -dmin mn,
// both exact in float32 (11-bit mantissas times 6-bit integers), and q d_b is exact too, so the
// tiles' one FMA per weight gives ggml's two-step value bit for bit; from there on Q4_K is Q4_1.
//
// Q6_K (Q4_K_M's output and half its attn_v / ffn_down) is widened to bytes, 8.5 bits per
// weight: on AVX2 an int8 row multiplies faster than 6-bit fields unpack (Q8_0 at M = 1 reads
// ~20 GB/s here, a Q4 row ~14), and nothing is requantized:
//   qs [N, K] int8: q - 32 in [-32, 31], elements in order
//   d  [N, K/256] fp16: each super-block's d;   m [N, K/16] int8: each 16 elements' scale
//   w[n, 16 h + j] = (d sc_h) (q - 32)   (exact: 11 + 7 + 6 bits)
// row_scales gives each 32-block's two scales, its first half's in sd and its second's in sm;
// qlinear_tile_q6 multiplies the halves by them. Every build runs the same AVX2 tile, and the
// 8-bit-activation path is not taken for Q6_K (qlinear computes it in float32).
//
// MXFP4 (gpt-oss's experts; ggml type 39) keeps its 4.25 bits per weight: 32 e2m1 values per
// block and one power-of-two scale byte (UE8), as ggml stores it with the byte moved out:
//   qs [N, K/2] uint8: nibbles in Q4's order (byte j: element j low, element j + 16 high)
//   m  [N, K/32] uint8: each block's exponent e;  d: empty
//   w[n, 32 b + j] = kE2M1x2[q] * 2^(e - 128)   (ggml's kvalues_mxfp4, e2m1 doubled; exact)
// The tiles look the nibbles up as int8 (vpshufb) and then run as Q8_0's: float32 activations
// against the int8 values times 2^(e - 128), or the 8-bit activations' integer sums.
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
  // Q4_K: [N, nb / 8, 2, 8] scales, then mins, per super-block; Q6_K: [N, 2 nb] int8 scales
  // MXFP4: [N, nb] exponent bytes
  const uint8_t* ks = nullptr;
  int64_t qs_row() const { return qtype == kQ8_0 || qtype == kQ6_K ? K : K / 2; }
  int64_t d_row() const {  // d's elements per row
    return qtype == kQ4_K ? nb / 4 : qtype == kQ6_K ? nb / 8 : qtype == kMXFP4 ? 0 : nb;
  }
  int64_t ks_row() const { return qtype == kMXFP4 ? nb : 2 * nb; }  // ks bytes per row
};

// e2m1 values doubled (ggml's kvalues_mxfp4), and an MXFP4 block's scale 2^(e - 128) (ggml's
// ggml_e8m0_to_fp32_half: the halving the doubled values need; e < 2 gives a subnormal).
alignas(16) constexpr int8_t kE2M1x2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : static_cast<uint32_t>(e - 1) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

#if defined(__AVX2__)
inline __m256 load_half8(const uint16_t* p) {  // 8 fp16 -> float (F16C)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256i load_u8x8(const uint8_t* p) {  // 8 bytes -> 8 int32 lanes, zero-extended
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline __m256i load_i8x8(const uint8_t* p) {  // 8 bytes -> 8 int32 lanes, sign-extended
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline float reduce_add8(__m256 v) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 h2 = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h2, _mm_movehdup_ps(h2)));
}
#endif

// The NR rows' scales (and offsets) starting at row n, as float: sd[r * nb + b].
inline void row_scales(const QWeight& w, int64_t n, int NR, float* sd, float* sm) {
  const int64_t count = NR * w.nb;  // the NR rows' scales are contiguous
  if (w.qtype == kQ4_K) {  // (d, dmin) per super-block of 8 blocks; its 8 scales, 8 mins
    const uint16_t* dd = w.d + n * w.d_row();
    const uint8_t* ks = w.ks + n * w.nb * 2;
    for (int64_t s = 0; s < count / 8; ++s) {
      const float d = _cvtsh_ss(dd[2 * s]), dmin = _cvtsh_ss(dd[2 * s + 1]);
      const uint8_t* k = ks + 16 * s;
#if defined(__AVX2__)
      _mm256_storeu_ps(sd + 8 * s, _mm256_mul_ps(_mm256_set1_ps(d),
                                                 _mm256_cvtepi32_ps(load_u8x8(k))));
      _mm256_storeu_ps(sm + 8 * s, _mm256_mul_ps(_mm256_set1_ps(-dmin),
                                                 _mm256_cvtepi32_ps(load_u8x8(k + 8))));
#else
      for (int64_t j = 0; j < 8; ++j) {
        sd[8 * s + j] = d * static_cast<float>(k[j]);
        sm[8 * s + j] = -dmin * static_cast<float>(k[8 + j]);
      }
#endif
    }
    return;
  }
  if (w.qtype == kMXFP4) {  // a power of two per block, no offset
    const uint8_t* e = w.ks + n * w.nb;
    for (int64_t b = 0; b < count; ++b) {
      sd[b] = e8m0_half(e[b]);
      sm[b] = 0.0f;
    }
    return;
  }
  if (w.qtype == kQ6_K) {  // d per super-block, a scale per 16 elements: sd first halves, sm second
    const uint16_t* dd = w.d + n * w.d_row();
    const int8_t* ks = reinterpret_cast<const int8_t*>(w.ks) + n * w.nb * 2;
    for (int64_t b = 0; b < count; ++b) {
      const float d = _cvtsh_ss(dd[b / 8]);
      sd[b] = d * static_cast<float>(ks[2 * b]);
      sm[b] = d * static_cast<float>(ks[2 * b + 1]);
    }
    return;
  }
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
    const __m256 df = load_half8(d + i);
    _mm256_storeu_ps(sd + i, df);
    _mm256_storeu_ps(sm + i, m ? load_half8(m + i)
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
// the line-fill buffers and stalls the loads behind it); 16 rows ahead measured the same. The
// AVX2 tiles do the same (float32, M = 1 on 1 thread: 14.4 -> 10.8 ms).
// The hint is T1 (into L2), not T0: a prefetch into L1 holds one of its ~24 miss buffers until
// the line arrives, which capped one core's stream at ~10 GB/s of the ~28 it can read; into L2
// it is 16-17 GB/s on 1 thread and ~30 on 2 (Q8_0, M = 1, 67 MB of weights, AVX-512 EPYC with
// VNNI; the 8-bit-activation tiles, which take the same prefetch, 8.3 -> 21.6 on 1 thread).
// A DeepSeek-V3-shaped decode step at ~100 tokens of context: 11.7 -> 9.4 ms (q8_0) / 8.3
// (q8_0-a8). 16 or 32 rows ahead, or T2, measured the same as 8.
// Short rows take more of them: the distance is at least kAheadBytes of rows (an MLA head's
// absorbed W_UK^T has rows of 64 bytes, a MoE expert's down projection of 256-512), and it runs
// on past the rows this call owns (a prefetch never faults, and the rows after an expert's or a
// head's are usually the next task's).
constexpr int64_t kAheadRows = 8, kAheadBytes = 8192;
inline int64_t ahead_rows(int64_t row_bytes) {
  return std::max<int64_t>(kAheadRows, (kAheadBytes + row_bytes - 1) / row_bytes);
}

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
  const int64_t ahead = ahead_rows(row);
  for (int64_t b = 0; b < w.nb; ++b) {
    if ((b * qb) % 64 == 0)
      for (int r = 0; r < NR; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(q0 + (r + ahead) * row + b * qb),
                     _MM_HINT_T1);
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
// One SmolLM2-135M step's linears (Q4_1 + the Q8_0 LM head) at M = 1, against the plain loops
// below, medians of interleaved runs: 1 thread 48.2 -> 10.6 ms, 2 threads 26.6 -> 6.6 (the
// AVX-512 tile on the same CPU: 10.4 and 6.4; docs/benchmarks.md, "AVX2 kernels").
template <int NR, int MT>
void qlinear_tile(const QWeight& w, int64_t n, const float* sd, const float* sm, const float* x,
                  int64_t ldx, float* out, int64_t ldo) {
  const int64_t qb = w.qtype == kQ8_0 ? 32 : 16, row = w.qs_row();
  const uint8_t* q0 = w.qs + n * row;
  const bool q8 = w.qtype == kQ8_0;
  // Two FMA chains per (weight row, x row) when there are few x rows: a Q4 block's 4 FMAs per
  // row would otherwise wait on each other (M = 1, 1 thread: 1 chain 12.4 ms, 2 chains 10.6,
  // 4 chains 11.2).
  constexpr int NA = MT <= 2 ? 2 : 1;
  __m256 acc[NR][MT][NA];
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < MT; ++i)
      for (int a = 0; a < NA; ++a) acc[r][i][a] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi32(0x0F);
  const int64_t ahead = ahead_rows(row);
  for (int64_t b = 0; b < w.nb; ++b) {
    if ((b * qb) % 64 == 0)
      for (int r = 0; r < NR; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(q0 + (r + ahead) * row + b * qb),
                     _MM_HINT_T1);
    for (int r = 0; r < NR; ++r) {
      const uint8_t* q = q0 + r * row + b * qb;
      const __m256 d = _mm256_set1_ps(sd[r * w.nb + b]);
      if (q8) {
        __m256 wq[4];
        for (int g = 0; g < 4; ++g) wq[g] = _mm256_cvtepi32_ps(load_i8x8(q + 8 * g));
        for (int i = 0; i < MT; ++i) {
          const float* xb = x + i * ldx + b * kQK;
          __m256 t = _mm256_mul_ps(wq[0], _mm256_loadu_ps(xb));
          for (int g = 1; g < 4; ++g) t = _mm256_fmadd_ps(wq[g], _mm256_loadu_ps(xb + 8 * g), t);
          acc[r][i][0] = _mm256_fmadd_ps(t, d, acc[r][i][0]);
        }
      } else {
        // bytes 0-7 hold elements 0-7 (low nibbles) and 16-23 (high), bytes 8-15: 8-15, 24-31
        const __m256 m = _mm256_set1_ps(sm[r * w.nb + b]);
        const __m256i b0 = load_u8x8(q), b1 = load_u8x8(q + 8);
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
      out[i * ldo + r] = reduce_add8(s);
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
// less time on 2 threads and 24% less on 1 (interleaved A/B, 25 passes each). The tiles on
// AVX2 and AVX-512 now ask for their rows themselves, spread through the block loop
// (kAheadRows), which is faster still; only the plain loops take the rows from here.
constexpr int64_t kPrefetchGroups = 2;

inline void prefetch_weight_rows(const QWeight& w, int64_t n, int NR, bool rows) {
  const int64_t ahead = n + kPrefetchGroups * NR;
  if (ahead + NR > w.N) return;
  auto fetch = [](const void* p, int64_t bytes) {
    const char* c = static_cast<const char*>(p);
    for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(c + i, _MM_HINT_T0);
  };
  if (rows) fetch(w.qs + ahead * w.qs_row(), NR * w.qs_row());
  fetch(w.d + ahead * w.d_row(), NR * w.d_row() * 2);
  if (w.m) fetch(w.m + ahead * w.nb, NR * w.nb * 2);
  if (w.ks) fetch(w.ks + ahead * w.ks_row(), NR * w.ks_row());
}

// Q6_K rows (bytes q - 32, two scales per 32-block: sd for elements 0-15, sm for 16-31) against
// MT rows of x: the AVX2 Q8_0 tile with the block's two halves scaled apart. The same code in
// every build (all of them have AVX2), so one tile is tested everywhere.
template <int NR, int MT>
void qlinear_tile_q6(const QWeight& w, int64_t n, const float* sd, const float* sm,
                     const float* x, int64_t ldx, float* out, int64_t ldo) {
  const int64_t row = w.qs_row();
  const uint8_t* q0 = w.qs + n * row;
#if defined(__AVX2__)
  __m256 acc[NR][MT];
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < MT; ++i) acc[r][i] = _mm256_setzero_ps();
  const int64_t ahead = ahead_rows(row);
  for (int64_t b = 0; b < w.nb; ++b) {
    if (b % 2 == 0)
      for (int r = 0; r < NR; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(q0 + (r + ahead) * row + b * kQK),
                     _MM_HINT_T1);
    for (int r = 0; r < NR; ++r) {
      const uint8_t* q = q0 + r * row + b * kQK;
      __m256 wq[4];
      for (int g = 0; g < 4; ++g) wq[g] = _mm256_cvtepi32_ps(load_i8x8(q + 8 * g));
      const __m256 dl = _mm256_set1_ps(sd[r * w.nb + b]), dh = _mm256_set1_ps(sm[r * w.nb + b]);
      for (int i = 0; i < MT; ++i) {
        const float* xb = x + i * ldx + b * kQK;
        const __m256 lo = _mm256_fmadd_ps(wq[1], _mm256_loadu_ps(xb + 8),
                                          _mm256_mul_ps(wq[0], _mm256_loadu_ps(xb)));
        const __m256 hi = _mm256_fmadd_ps(wq[3], _mm256_loadu_ps(xb + 24),
                                          _mm256_mul_ps(wq[2], _mm256_loadu_ps(xb + 16)));
        acc[r][i] = _mm256_fmadd_ps(hi, dh, _mm256_fmadd_ps(lo, dl, acc[r][i]));
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < MT; ++i) out[i * ldo + r] = reduce_add8(acc[r][i]);
#else
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < MT; ++i) {
      float acc = 0;
      for (int64_t b = 0; b < w.nb; ++b) {
        const int8_t* q = reinterpret_cast<const int8_t*>(q0 + r * row + b * kQK);
        const float* xb = x + i * ldx + b * kQK;
        float lo = 0, hi = 0;
        for (int j = 0; j < 16; ++j) lo += static_cast<float>(q[j]) * xb[j];
        for (int j = 16; j < 32; ++j) hi += static_cast<float>(q[j]) * xb[j];
        acc += lo * sd[r * w.nb + b] + hi * sm[r * w.nb + b];
      }
      out[i * ldo + r] = acc;
    }
#endif
}

#if defined(__AVX2__)
// An MXFP4 block's 16 bytes -> its 32 values (e2m1 doubled) as int8 in element order: the
// nibbles split, each looked up in kE2M1x2 by vpshufb.
inline __m256i mxfp4_values(const uint8_t* q) {
  const __m128i lut = _mm_load_si128(reinterpret_cast<const __m128i*>(kE2M1x2));
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m128i low4 = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(bytes, 4), low4)),
                          _mm_shuffle_epi8(lut, _mm_and_si128(bytes, low4)));
}
#endif

// MXFP4 rows (sd: each block's 2^(e - 128)) against MT rows of x: the looked-up int8 values
// through the AVX2 Q8_0 tile (w = d v with d a power of two, so scaling the block's sum by d
// is exact). The same code in every build, as qlinear_tile_q6.
template <int NR, int MT>
void qlinear_tile_mxfp4(const QWeight& w, int64_t n, const float* sd, const float* x,
                        int64_t ldx, float* out, int64_t ldo) {
  const int64_t row = w.qs_row();
  const uint8_t* q0 = w.qs + n * row;
#if defined(__AVX2__)
  __m256 acc[NR][MT];
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < MT; ++i) acc[r][i] = _mm256_setzero_ps();
  const int64_t ahead = ahead_rows(row);
  for (int64_t b = 0; b < w.nb; ++b) {
    if (b % 4 == 0)
      for (int r = 0; r < NR; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(q0 + (r + ahead) * row + b * 16), _MM_HINT_T1);
    for (int r = 0; r < NR; ++r) {
      const __m256i v = mxfp4_values(q0 + r * row + b * 16);
      const __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
      const __m256 wq[4] = {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)),
                            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))),
                            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)),
                            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)))};
      const __m256 d = _mm256_set1_ps(sd[r * w.nb + b]);
      for (int i = 0; i < MT; ++i) {
        const float* xb = x + i * ldx + b * kQK;
        __m256 t = _mm256_mul_ps(wq[0], _mm256_loadu_ps(xb));
        for (int g = 1; g < 4; ++g) t = _mm256_fmadd_ps(wq[g], _mm256_loadu_ps(xb + 8 * g), t);
        acc[r][i] = _mm256_fmadd_ps(t, d, acc[r][i]);
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < MT; ++i) out[i * ldo + r] = reduce_add8(acc[r][i]);
#else
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < MT; ++i) {
      float acc = 0;
      for (int64_t b = 0; b < w.nb; ++b) {
        const uint8_t* q = q0 + r * row + b * 16;
        const float* xb = x + i * ldx + b * kQK;
        float t = 0;
        for (int j = 0; j < 16; ++j)
          t += kE2M1x2[q[j] & 0xF] * xb[j] + kE2M1x2[q[j] >> 4] * xb[j + 16];
        acc += t * sd[r * w.nb + b];
      }
      out[i * ldo + r] = acc;
    }
#endif
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
  if (w.qtype == kMXFP4) {
    constexpr int TRF = MT <= 4 ? 2 : 1;  // AVX2's 16 registers, as TR above
    if constexpr (NR % TRF == 0) {
      for (int r = 0; r < NR; r += TRF)
        qlinear_tile_mxfp4<TRF, MT>(w, n + r, sd + r * w.nb, x, w.K, out + r, w.N);
    } else {
      qlinear_tile_mxfp4<NR, MT>(w, n, sd, x, w.K, out, w.N);
    }
    return;
  }
  if (w.qtype == kQ6_K) {
    constexpr int TR6 = MT <= 4 ? 2 : 1;  // AVX2's 16 registers, as TR above
    if constexpr (NR % TR6 == 0) {
      for (int r = 0; r < NR; r += TR6)
        qlinear_tile_q6<TR6, MT>(w, n + r, sd + r * w.nb, sm + r * w.nb, x, w.K, out + r, w.N);
    } else {
      qlinear_tile_q6<NR, MT>(w, n, sd, sm, x, w.K, out, w.N);
    }
    return;
  }
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

// The repacked ggml weight `[N, K]` (qs, d, m as hearth.ops.cpu_kernels.pack_ggml lays them
// out), checked; errors start with `what` (the op, and which weight).
QWeight packed_weight(const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m,
                      int64_t qtype, int64_t N, int64_t K, const char* what) {
  TORCH_CHECK(qtype == kQ4_0 || qtype == kQ4_1 || qtype == kQ8_0 || qtype == kQ4_K ||
                  qtype == kQ6_K || qtype == kMXFP4,
              what, ": unsupported ggml type ", qtype);
  TORCH_CHECK(K % kQK == 0, what, ": in_features must be a multiple of 32");
  const bool kquant = qtype == kQ4_K || qtype == kQ6_K;
  TORCH_CHECK(!kquant || K % kQK_K == 0, what, ": Q4_K / Q6_K need in_features % 256 == 0");
  const int64_t nb = K / kQK, qs_row = qtype == kQ8_0 || qtype == kQ6_K ? K : K / 2;
  const int64_t d_row = qtype == kQ4_K ? nb / 4 : qtype == kQ6_K ? nb / 8 : qtype == kMXFP4 ? 0 : nb;
  TORCH_CHECK(qs.scalar_type() == at::kByte && qs.is_contiguous() && qs.numel() == N * qs_row,
              what, ": qs does not match the repacked ggml layout");
  TORCH_CHECK(d.scalar_type() == at::kHalf && d.is_contiguous() && d.numel() == N * d_row, what,
              ": d must be float16 [N, K/32] (Q4_K: [N, K/256, 2]; Q6_K: [N, K/256])");
  TORCH_CHECK(qtype != kQ4_1 || (m.scalar_type() == at::kHalf && m.is_contiguous() &&
                                 m.numel() == N * nb),
              what, ": Q4_1 needs m float16 [N, K/32]");
  TORCH_CHECK(!kquant || (m.scalar_type() == at::kByte && m.is_contiguous() &&
                          m.numel() == N * nb * 2),
              what, ": Q4_K needs m uint8 [N, K/256, 2, 8] (Q6_K: [N, K/16] scales)");
  TORCH_CHECK(qtype != kMXFP4 || (m.scalar_type() == at::kByte && m.is_contiguous() &&
                                  m.numel() == N * nb),
              what, ": MXFP4 needs m uint8 [N, K/32] (each block's exponent)");
  QWeight w{qtype, N, K, nb, qs.data_ptr<uint8_t>(),
            reinterpret_cast<const uint16_t*>(d.data_ptr()),
            qtype == kQ4_1 ? reinterpret_cast<const uint16_t*>(m.data_ptr()) : nullptr};
  if (kquant || qtype == kMXFP4) w.ks = m.data_ptr<uint8_t>();
  return w;
}

// Row n of a packed weight as float32 values o [K]: the exact values qlinear multiplies by
// (ggml's dequantization of the same blocks). sd, sm: scratch of w.nb floats each.
void decode_row(const QWeight& w, int64_t n, float* o, float* sd, float* sm) {
  row_scales(w, n, 1, sd, sm);
  const uint8_t* q = w.qs + n * w.qs_row();
  for (int64_t b = 0; b < w.nb; ++b) {
    const float db = sd[b], mb = sm[b];
    float* ob = o + b * kQK;
    if (w.qtype == kQ8_0) {
      const int8_t* q8 = reinterpret_cast<const int8_t*>(q + b * kQK);
#pragma omp simd
      for (int j = 0; j < 32; ++j) ob[j] = static_cast<float>(q8[j]) * db;
    } else if (w.qtype == kMXFP4) {
      const uint8_t* q4 = q + b * 16;
      for (int j = 0; j < 16; ++j) {
        ob[j] = static_cast<float>(kE2M1x2[q4[j] & 0xF]) * db;
        ob[j + 16] = static_cast<float>(kE2M1x2[q4[j] >> 4]) * db;
      }
    } else if (w.qtype == kQ6_K) {  // sm: the second half's scale
      const int8_t* q6 = reinterpret_cast<const int8_t*>(q + b * kQK);
#pragma omp simd
      for (int j = 0; j < 16; ++j) {
        ob[j] = static_cast<float>(q6[j]) * db;
        ob[j + 16] = static_cast<float>(q6[j + 16]) * mb;
      }
    } else {
      const uint8_t* q4 = q + b * 16;
#pragma omp simd
      for (int j = 0; j < 16; ++j) {
        ob[j] = std::fma(static_cast<float>(q4[j] & 0xF), db, mb);
        ob[j + 16] = std::fma(static_cast<float>(q4[j] >> 4), db, mb);
      }
    }
  }
}

// Weight rows `rows` of a packed weight as float32 (or bf16) values [len(rows), K]: the exact
// values qlinear multiplies by (decode_row). Prompt steps multiply by tiles of it (a tile
// decoded once per step, reused by all of its rows), and an embedding table kept in blocks
// looks its rows up through it.
at::Tensor dequant_rows(const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m,
                        int64_t qtype, int64_t out_features, int64_t in_features,
                        const at::Tensor& rows_in, bool bf16_out, int64_t threads) {
  const QWeight w = packed_weight(qs, d, m, qtype, out_features, in_features, "dequant_rows");
  TORCH_CHECK(rows_in.scalar_type() == at::kLong, "dequant_rows: rows must be int64");
  at::Tensor rows = rows_in.reshape({-1}).contiguous();
  const int64_t R = rows.size(0), K = w.K, nb = w.nb;
  const int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < R; ++i)
    TORCH_CHECK(rp[i] >= 0 && rp[i] < w.N, "dequant_rows: row ", rp[i], " out of range [0, ",
                w.N, ")");
  at::Tensor out = at::empty({R, K}, qs.options().dtype(bf16_out ? at::kBFloat16 : at::kFloat));
  void* base = out.data_ptr();
  constexpr int64_t kRowsPerTask = 16;
  parallel_tasks((R + kRowsPerTask - 1) / kRowsPerTask, [&](int64_t task) {
    std::vector<float> sd(nb), sm(nb), row(K);
    for (int64_t i = task * kRowsPerTask; i < std::min(R, (task + 1) * kRowsPerTask); ++i) {
      float* o = bf16_out ? row.data() : static_cast<float*>(base) + i * K;
      decode_row(w, rp[i], o, sd.data(), sm.data());
      if (bf16_out) {
        uint16_t* ob = static_cast<uint16_t*>(base) + i * K;
#pragma omp simd
        for (int64_t k = 0; k < K; ++k) ob[k] = float_to_bf16(o[k]);
      }
    }
  }, threads);
  return out;
}

// A packed weight's rows requantized to ggml Q8_0 blocks [N, K/32 * 34] (fp16 d = max|w| / 127
// rounded to nearest, q = round(w / d) clamped to +-127: hearth.models.quant.quantize_q8_0's
// numbers, bit for bit, without a float copy of the weight). For a merged projection whose parts
// the file stores in different formats (Q4_K_M's Q4_K q/k beside a Q6_K v): one packed weight
// has one format.
at::Tensor requantize_q8_0(const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m,
                           int64_t qtype, int64_t out_features, int64_t in_features,
                           int64_t threads) {
  const QWeight w = packed_weight(qs, d, m, qtype, out_features, in_features, "requantize_q8_0");
  const int64_t N = w.N, K = w.K, nb = w.nb;
  at::Tensor out = at::empty({N, nb * 34}, qs.options());
  uint8_t* op = out.data_ptr<uint8_t>();
  at::Tensor rows = at::arange(N, qs.options().dtype(at::kLong));
  constexpr int64_t kRowsPerTask = 64;
  parallel_tasks((N + kRowsPerTask - 1) / kRowsPerTask, [&](int64_t task) {
    const int64_t r0 = task * kRowsPerTask, r1 = std::min(N, r0 + kRowsPerTask);
    at::Tensor values = dequant_rows(qs, d, m, qtype, N, K, rows.narrow(0, r0, r1 - r0), false, 1);
    const float* v = values.data_ptr<float>();
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t b = 0; b < nb; ++b) {
        const float* x = v + (r - r0) * K + b * kQK;
        float amax = 0;
        for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[j]));
        const uint16_t dh = _cvtss_sh(amax / 127.0f, _MM_FROUND_TO_NEAREST_INT);
        const float df = _cvtsh_ss(dh), inv = df > 0 ? 1.0f / df : 0.0f;
        uint8_t* blk = op + (r * nb + b) * 34;
        std::memcpy(blk, &dh, 2);
        for (int j = 0; j < 32; ++j) {
          const float q = std::min(127.0f, std::max(-127.0f, std::nearbyint(x[j] * inv)));
          blk[2 + j] = static_cast<uint8_t>(static_cast<int8_t>(q));
        }
      }
  }, threads);
  return out;
}

