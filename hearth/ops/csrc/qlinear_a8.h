// qlinear with 8-bit activations (the -a8 formats): activation quantization and the decode
// tiles; the prompt steps' K-quant GEMMs are in kquant_gemm.h, the qlinear op in qlinear_op.h.
//
// A fragment of hearth's one kernel build: included by cpu_kernels.cpp inside
// namespace hearth::(anonymous), after the headers listed before it there (qlinear.h's
// QWeight, row_scales and prefetch_weight_rows).

// qlinear with 8-bit activations (llama.cpp's way for a decode step): each 32-element block of a
// row of x is quantized to int8 with its own float scale (dx = max|x| / 127, qx = round(x / dx)),
// and a block's dot product is an integer sum:
//   sum_j (d q_j + m) (dx qx_j) = d dx sum_j q_j qx_j + m dx sum_j qx_j.
// With AVX512-VNNI one `vpdpbusd` multiplies 64 unsigned by 64 signed bytes and sums them in
// groups of 4: a 64-byte register covers two blocks (lanes 0-7 block 2p, 8-15 block 2p + 1).
// Q4 nibbles are the unsigned operand; Q8_0 weights (signed) are offset by 128 in registers, and
// 128 * sum(qx) is subtracted. Without VNNI the same integer sums run on AVX2's vpmaddubsw (or,
// without AVX2, in plain loops), so every build computes the same numbers (up to float
// summation order).

// How a call lays out its quantized activations: the order the weight loop reads them in.
enum ActLayout {
  kNatural = 0,   // int8, row order (the plain loops, AVX2, and VNNI x Q8_0)
  kQ4Pairs = 1,   // int8, per 2 blocks: their first halves (elements 0-15), then their second
                  // halves: the order of a 32-byte load of 2 Q4 blocks split into low and high
                  // nibbles (AVX2 x Q4_K)
  kQ4Quads = 2,   // int8, per 4 blocks: their first halves (elements 0-15), then their second
                  // halves: the order of a 64-byte load of 4 Q4 blocks split into low and high nibbles
  kQ4KPanel = 3,  // int8, per 256-element super-block 8 runs of 32 bytes: run t holds elements
                  // 4t..4t+3 of each of its 8 blocks (block b at bytes 4b..4b+3): the order of
                  // q4k_repack_row's weights (the AVX2 Q4_K GEMM, qlinear_q4k_gemm)
  kQ6KPanel = 4,  // int8, per super-block 8 runs of 32 bytes: run t holds elements 2t, 2t + 1
                  // of each of its 16 groups of 16 (group g at bytes 2g, 2g + 1; q6k_repack_row)
};

struct QAct {
  int64_t M, nb, stride;  // stride: bytes per row of q
  const int8_t* q;
  const float* dx;   // [M, nb] block scales
  const float* xs;   // [M, nb] dx * sum(qx) of each block (the offset terms)
  const float* dxe;  // [M, groups, 16] each block's dx spread over the lanes its dot product fills
};

// Rows [p0, p0 + M) of `act` (an expert's pairs, a GEMM's block of rows); dxe_row: the per-row
// stride of act.dxe (0 where the reader does not use it).
QAct act_rows(const QAct& act, int64_t p0, int64_t M, int64_t dxe_row) {
  return QAct{M, act.nb, act.stride, act.q + p0 * act.stride, act.dx + p0 * act.nb,
              act.xs + p0 * act.nb, act.dxe + p0 * dxe_row};
}

inline int64_t act_group(int layout) { return layout == kQ4Quads ? 4 : 2; }  // blocks per register
inline int64_t act_stride(int layout, int64_t nb) {
  return layout == kQ4Quads ? (nb + 3) / 4 * 128 : layout == kQ4Pairs ? (nb + 1) / 2 * 64 : nb * kQK;
}

// `span` elements share one scale: 32 (a block; every path but one) or 256 (a Q4_K super-block,
// llama.cpp's Q8_K, for the AVX2 Q4_K tile's integer sums over a whole super-block).
void quantize_rows(const float* x, int64_t M, int64_t K, int layout, int8_t* q, float* dx,
                   float* xs, float* dxe, int64_t span = kQK) {
  const int64_t nb = K / kQK, G = act_group(layout), ng = (nb + G - 1) / G, lanes = 16 / G;
  const int64_t stride = act_stride(layout, nb), per = span / kQK;
  std::memset(q, 0, M * stride);
  std::fill(dxe, dxe + M * ng * 16, 0.0f);
  for (int64_t i = 0; i < M; ++i) {
    float amax = 0;
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + i * K + b * kQK;
      if (b % per == 0) {
        amax = 0;
        for (int64_t j = 0; j < span; ++j) amax = std::max(amax, std::fabs(xb[j]));
      }
      const float d = amax / 127.0f, inv = amax > 0 ? 127.0f / amax : 0.0f;
      int32_t sum = 0;
      for (int j = 0; j < kQK; ++j) {
        const int32_t v = static_cast<int32_t>(std::nearbyint(xb[j] * inv));
        sum += v;
        if (layout == kQ4Quads)
          q[i * stride + (b / 4) * 128 + (j / 16) * 64 + (b % 4) * 16 + j % 16] = static_cast<int8_t>(v);
        else if (layout == kQ6KPanel)
          q[i * stride + (b / 8) * 256 + ((32 * (b % 8) + j) % 16 / 2) * 32 +
            (32 * (b % 8) + j) / 16 * 2 + j % 2] = static_cast<int8_t>(v);
        else if (layout == kQ4KPanel)
          q[i * stride + (b / 8) * 256 + (j / 4) * 32 + (b % 8) * 4 + j % 4] = static_cast<int8_t>(v);
        else if (layout == kQ4Pairs)
          q[i * stride + (b / 2) * 64 + (j / 16) * 32 + (b % 2) * 16 + j % 16] = static_cast<int8_t>(v);
        else
          q[i * stride + b * kQK + j] = static_cast<int8_t>(v);
      }
      dx[i * nb + b] = d;
      xs[i * nb + b] = d * static_cast<float>(sum);
      for (int64_t l = 0; l < lanes; ++l) dxe[(i * ng + b / G) * 16 + (b % G) * lanes + l] = d;
    }
  }
}

// The offset terms of a weight row against an activation row: sum_b m_b dx_b sum(qx_b), m_b
// from row_scales (Q4_1's m, Q4_0's -8 d, Q4_K's -dmin mn), a.xs = dx sum(qx) per block.
inline float offset_term(const float* smr, const QAct& a, int64_t row) {
  const float* xs = a.xs + row * a.nb;
  float m = 0;
#pragma omp simd reduction(+ : m)
  for (int64_t b = 0; b < a.nb; ++b) m += smr[b] * xs[b];
  return m;
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
    // Q8_0: 2 blocks (64 bytes) per load, lane l of the sum belongs to block l / 8. vpdpbusd
    // wants one side unsigned: the weights become q + 128 (an xor with 0x80), so each block's
    // sum carries 128 * sum(qx), taken off after the loop as 128 * sum_b d_b a.xs[b] (a.xs =
    // dx * sum(qx)). Full pairs run branch-free; an odd last block is one masked pass. Against
    // the activations offset instead (a second vpdpbusd of the weights with ones per row and
    // pair, and masked loads chosen per pair, which spilled the accumulators): a cold 67 MB
    // pass at M = 1, 1 thread 19-21 -> 22-24 GB/s.
    const uint8_t* q0 = w.qs + n * w.K;
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    const __m512i pair_idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const int64_t full = nb / 2, ng = (nb + 1) / 2;
    const int64_t ahead = ahead_rows(w.K);  // qlinear_tile's prefetch (qlinear.h)
    auto pair = [&](int64_t p, __mmask64 bytes, __mmask8 scales) __attribute__((always_inline)) {
      __m512i xv[MT];
      __m512 dxv[MT];
      for (int i = 0; i < MT; ++i) {
        xv[i] = _mm512_maskz_loadu_epi8(bytes, a.q + (i0 + i) * a.stride + p * 64);
        dxv[i] = _mm512_loadu_ps(a.dxe + ((i0 + i) * ng + p) * 16);
      }
      for (int r = 0; r < NR; ++r) {
        const __m512 dw = _mm512_permutexvar_ps(
            pair_idx, _mm512_castps128_ps512(_mm_maskz_loadu_ps(scales, sd + r * nb + 2 * p)));
        const __m512i wv = _mm512_xor_si512(
            _mm512_maskz_loadu_epi8(bytes, q0 + r * w.K + p * 64), flip);
        for (int i = 0; i < MT; ++i) {
          const __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, xv[i]);
          acc[r][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw, dxv[i]), acc[r][i]);
        }
      }
    };
    for (int64_t p = 0; p < full; ++p) {
      for (int r = 0; r < NR; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(q0 + (r + ahead) * w.K + p * 64), _MM_HINT_T1);
      pair(p, ~0ull, 3);
    }
    if (nb % 2) pair(full, 0xFFFFFFFFull, 1);  // the last block alone (masked-off bytes: 0)
    // acc -= 128 * sd[b] * xs[b], 16 blocks per FMA, before the one horizontal sum
    const __m512 m128 = _mm512_set1_ps(-128.0f);
    for (int64_t b = 0; b < nb; b += 16) {
      const __mmask16 mask = nb - b >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (nb - b)) - 1);
      __m512 xs[MT];
      for (int i = 0; i < MT; ++i)
        xs[i] = _mm512_mul_ps(m128, _mm512_maskz_loadu_ps(mask, a.xs + (i0 + i) * nb + b));
      for (int r = 0; r < NR; ++r) {
        const __m512 sdr = _mm512_maskz_loadu_ps(mask, sd + r * nb + b);
        for (int i = 0; i < MT; ++i) acc[r][i] = _mm512_fmadd_ps(sdr, xs[i], acc[r][i]);
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
  const int64_t ahead = ahead_rows(w.K / 2);
  for (int64_t c = 0; c < nq; ++c) {
    for (int r = 0; r < NR; ++r)
      _mm_prefetch(reinterpret_cast<const char*>(q0 + (r + ahead) * (w.K / 2) + c * 64), _MM_HINT_T1);
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
    for (int i = 0; i < MT; ++i)
      out[i * ldo + r] = _mm512_reduce_add_ps(acc[r][i]) + offset_term(sm + r * nb, a, i0 + i);
}
#elif defined(__AVX2__)
// Q4_K with 8-bit activations on AVX2 (llama.cpp's Q4_K x Q8_K): a super-block's activations
// share one scale (quantize_act: span 256), so its dot product is integer sums to its end. Per
// pair of 32-blocks one 32-byte load of nibbles splits into both blocks' first halves (low
// nibbles) and second halves (high), which the kQ4Pairs order of x matches; vpmaddubsw's int16
// sums of the two halves (|.| <= 2 * 2 * 15 * 127) meet the blocks' 6-bit scales in one
// vpmaddwd, and one float FMA per super-block applies d dx. The mins' term, -dmin mn times each
// block's sum of x, is the short float loop after (sm . xs), as for Q4_1.
// vpshufb controls over 8 int16 scales held in both 128-bit lanes: pick p fills lane 0 with
// scale 2p and lane 1 with scale 2p + 1 (the two 32-blocks of a pair, or a 32-element run's two
// 16-element halves).
// (a namespace-scope table: a function-local static with a constructor costs a guard check
// per call)
alignas(32) constexpr int8_t kScalePicks[4][32] = {
    {0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3},
    {4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7},
    {8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11,
     10, 11, 10, 11},
    {12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 14, 15, 14, 15, 14, 15, 14, 15,
     14, 15, 14, 15, 14, 15, 14, 15}};
inline __m256i pick_scales(__m256i both, int p) {
  return _mm256_shuffle_epi8(both, _mm256_load_si256(reinterpret_cast<const __m256i*>(kScalePicks[p])));
}

template <int NR, int MT>
void qlinear_tile_q4k_i8(const QWeight& w, int64_t n, const QAct& a, int64_t i0, float* out,
                         int64_t ldo) {
  const int64_t row = w.K / 2, nb = w.nb, ns = nb / 8;
  const uint8_t* q0 = w.qs + n * row;
  const uint16_t* d0 = w.d + n * w.d_row();
  const uint8_t* k0 = w.ks + n * nb * 2;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256 acc[NR][MT];
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < MT; ++i) acc[r][i] = _mm256_setzero_ps();
  const int64_t ahead = ahead_rows(row);
  for (int64_t s = 0; s < ns; ++s) {
    __m256i isum[NR][MT], sc[NR];
    for (int r = 0; r < NR; ++r) {
      sc[r] = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(k0 + r * nb * 2 + 16 * s))));
      for (int i = 0; i < MT; ++i) isum[r][i] = _mm256_setzero_si256();
    }
    for (int p = 0; p < 4; ++p) {
      const int64_t off = s * 128 + p * 32;
      if (p % 2 == 0)
        for (int r = 0; r < NR; ++r)
          _mm_prefetch(reinterpret_cast<const char*>(q0 + (r + ahead) * row + off), _MM_HINT_T1);
      __m256i xa[MT], xb[MT];
      for (int i = 0; i < MT; ++i) {
        const int8_t* xp = a.q + (i0 + i) * a.stride + (4 * s + p) * 64;
        xa[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp));
        xb[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + 32));
      }
      for (int r = 0; r < NR; ++r) {
        const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q0 + r * row + off));
        const __m256i lo = _mm256_and_si256(wv, low4);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(wv, 4), low4);
        const __m256i scl = pick_scales(sc[r], p);
        for (int i = 0; i < MT; ++i) {
          const __m256i prod = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xa[i]),
                                                _mm256_maddubs_epi16(hi, xb[i]));
          isum[r][i] = _mm256_add_epi32(isum[r][i], _mm256_madd_epi16(prod, scl));
        }
      }
    }
    for (int r = 0; r < NR; ++r) {
      // d and dmin in one load; the mins' term -dmin mn_b dx sum(qx_b) joins the same lanes
      const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(
          *reinterpret_cast<const int32_t*>(d0 + r * w.d_row() + 2 * s)));
      const float d = _mm_cvtss_f32(dm);
      const __m256 mins = _mm256_mul_ps(_mm256_cvtepi32_ps(load_u8x8(k0 + r * nb * 2 + 16 * s + 8)),
                                        _mm256_set1_ps(-_mm_cvtss_f32(_mm_movehdup_ps(dm))));
      for (int i = 0; i < MT; ++i) {
        acc[r][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r][i]),
                                    _mm256_set1_ps(d * a.dx[(i0 + i) * nb + 8 * s]), acc[r][i]);
        acc[r][i] = _mm256_fmadd_ps(mins, _mm256_loadu_ps(a.xs + (i0 + i) * nb + 8 * s), acc[r][i]);
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < MT; ++i) out[i * ldo + r] = reduce_add8(acc[r][i]);
}

// Q6_K with 8-bit activations on AVX2, as Q4_K above: one activation scale per super-block, the
// widened values (q - 32, |.| <= 32) as |w| against x carrying w's sign in vpmaddubsw, whose
// int16 sums meet each 16 elements' int8 scale in one vpmaddwd; one float FMA per super-block.
template <int NR, int MT>
void qlinear_tile_q6k_i8(const QWeight& w, int64_t n, const QAct& a, int64_t i0, float* out,
                         int64_t ldo) {
  const int64_t K = w.K, nb = w.nb, ns = nb / 8;
  const int8_t* q0 = reinterpret_cast<const int8_t*>(w.qs) + n * K;
  const uint16_t* d0 = w.d + n * w.d_row();
  const int8_t* k0 = reinterpret_cast<const int8_t*>(w.ks) + n * nb * 2;
  __m256 acc[NR][MT];
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < MT; ++i) acc[r][i] = _mm256_setzero_ps();
  const int64_t ahead = ahead_rows(K);
  for (int64_t s = 0; s < ns; ++s) {
    __m256i isum[NR][MT], first[NR], second[NR];  // scales 0-7 / 8-15 in both lanes
    for (int r = 0; r < NR; ++r) {
      const __m256i s16 = _mm256_cvtepi8_epi16(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(k0 + r * nb * 2 + 16 * s)));
      first[r] = _mm256_permute4x64_epi64(s16, 0x44);
      second[r] = _mm256_permute4x64_epi64(s16, 0xEE);
      for (int i = 0; i < MT; ++i) isum[r][i] = _mm256_setzero_si256();
    }
    for (int c = 0; c < 8; ++c) {  // 32-element runs
      const int64_t off = s * 256 + c * 32;
      if (c % 2 == 0)
        for (int r = 0; r < NR; ++r)
          _mm_prefetch(reinterpret_cast<const char*>(q0 + (r + ahead) * K + off), _MM_HINT_T1);
      __m256i xv[MT];
      for (int i = 0; i < MT; ++i)
        xv[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + (i0 + i) * a.stride + off));
      for (int r = 0; r < NR; ++r) {
        const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q0 + r * K + off));
        const __m256i wabs = _mm256_abs_epi8(wv);
        const __m256i scl = pick_scales(c < 4 ? first[r] : second[r], c % 4);
        for (int i = 0; i < MT; ++i)
          isum[r][i] = _mm256_add_epi32(
              isum[r][i], _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, _mm256_sign_epi8(xv[i], wv)), scl));
      }
    }
    for (int r = 0; r < NR; ++r) {
      const float d = _cvtsh_ss(d0[r * w.d_row() + s]);
      for (int i = 0; i < MT; ++i)
        acc[r][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r][i]),
                                    _mm256_set1_ps(d * a.dx[(i0 + i) * nb + 8 * s]), acc[r][i]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < MT; ++i) out[i * ldo + r] = reduce_add8(acc[r][i]);
}

// AVX2 without VNNI (and the AVX-512 build without it): llama.cpp's AVX2 dot products over the
// row-order layout, one 32-element block per register. vpmaddubsw multiplies unsigned by signed
// bytes and adds neighbours into int16 lanes, vpmaddwd with ones sums those into 8 int32 lanes,
// and the block's d dx scales them into the accumulator. Q4 nibbles are the unsigned side
// (|pair| <= 2 * 15 * 127); Q8_0 weights are signed, so |w| meets x with w's sign (vpsignb):
// |pair| <= 2 * 128 * 127 < 2^15, so nothing saturates and the integer sums are exact.
// One SmolLM2-135M step's linears at M = 1, 2 threads, against the plain loops below: 42 -> 7.2
// ms (float32 activations through qlinear_tile: 7.0, so on AVX2 the -a8 formats save no time).
template <int NR, int MT>
void qlinear_tile_i8(const QWeight& w, int64_t n, const float* sd, const float* sm, const QAct& a,
                     int64_t i0, float* out, int64_t ldo) {
  if (w.qtype == kQ4_K) return qlinear_tile_q4k_i8<NR, MT>(w, n, a, i0, out, ldo);
  if (w.qtype == kQ6_K) return qlinear_tile_q6k_i8<NR, MT>(w, n, a, i0, out, ldo);
  const bool q8 = w.qtype == kQ8_0;
  const int64_t row = w.qs_row(), nb = w.nb;
  const uint8_t* q0 = w.qs + n * row;
  const __m256i ones = _mm256_set1_epi16(1);
  const __m128i low4 = _mm_set1_epi8(0x0F);
  __m256 acc[NR][MT];
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < MT; ++i) acc[r][i] = _mm256_setzero_ps();
  // qlinear_tile's prefetch of the rows kAheadRows on (M = 1: 14.6 -> 10.8 ms on 1 thread,
  // 9.2 -> 7.1 on 2, against prefetch_weight_rows' whole rows per group)
  const int64_t qb = q8 ? 32 : 16;
  const int64_t ahead = ahead_rows(row);
  for (int64_t b = 0; b < nb; ++b) {
    if ((b * qb) % 64 == 0)
      for (int r = 0; r < NR; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(q0 + (r + ahead) * row + b * qb),
                     _MM_HINT_T1);
    __m256i xv[MT];
    for (int i = 0; i < MT; ++i) {
      const int8_t* xp = a.q + (i0 + i) * a.stride + b * kQK;
      xv[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp));
    }
    for (int r = 0; r < NR; ++r) {
      const uint8_t* q = q0 + r * row + b * qb;
      __m256i p[MT];
      if (q8) {
        const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
        const __m256i wabs = _mm256_abs_epi8(wv);
        for (int i = 0; i < MT; ++i)
          p[i] = _mm256_maddubs_epi16(wabs, _mm256_sign_epi8(xv[i], wv));
      } else {
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
        const __m256i wu = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), low4),
                                            _mm_and_si128(bytes, low4));
        for (int i = 0; i < MT; ++i) p[i] = _mm256_maddubs_epi16(wu, xv[i]);
      }
      for (int i = 0; i < MT; ++i) {
        const __m256 s = _mm256_cvtepi32_ps(_mm256_madd_epi16(p[i], ones));
        const __m256 scale = _mm256_set1_ps(sd[r * nb + b] * a.dx[(i0 + i) * nb + b]);
        acc[r][i] = _mm256_fmadd_ps(s, scale, acc[r][i]);
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < MT; ++i)
      out[i * ldo + r] = reduce_add8(acc[r][i]) + (q8 ? 0.0f : offset_term(sm + r * nb, a, i0 + i));
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

// MXFP4 with 8-bit activations, every build (AVX2 code): x in the kQ4Pairs order (as Q4_K's
// tiles), a scale per 32-block. A 32-byte load of nibbles holds 2 blocks; each nibble is looked
// up (vpshufb) as v + 12 (0..24, kE2M1Plus12: unsigned, so vpmaddubsw takes it without the
// vpabsb / vpsignb pair a signed weight needs), and the offset comes back exactly per block:
// sum_j v_j qx_j = sum_j (v_j + 12) qx_j - 12 sum(qx), 12 sum(qx) = 12 xs / dx. vpmaddubsw's
// int16 sums of a pair (|.| <= 2 * 2 * 24 * 127) widen in one vpmaddwd (lanes 0-3: block 2p,
// 4-7: block 2p + 1), and two vphaddd rounds fold 4 pairs into one register of 8 block sums in
// the order 0 2 4 6 1 3 5 7, which the blocks' scales (2^(e - 128), from the exponent bits)
// and x's dx, xs take by one vpermps each: one float FMA per 8 blocks instead of one per block.
// Against the per-block tile it replaced (|w| / sign(x, w), a vpmaddwd and an FMA per block):
// M = 1, [5760, 2880] (gpt-oss), in cache: 1 thread 7.8 -> 13.5 GB/s of blocks, 2 threads 14.6 ->
// 23.3; from memory, 2 threads, 12.1 -> 16.3.
alignas(16) constexpr int8_t kE2M1Plus12[16] = {12, 13, 14, 15, 16, 18, 20, 24,
                                                12, 11, 10, 9, 8, 6, 4, 0};
// Element j (0..31) of block b in the kQ4Pairs order.
inline int64_t pairs_index(int64_t b, int64_t j) { return (b / 2) * 64 + (j / 16) * 32 + (b % 2) * 16 + j % 16; }

#if defined(__AVX2__)
inline __m256 e8m0_half8(__m256i e) {  // 8 exponents (int32) -> 2^(e - 128), as e8m0_half
  const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
  const __m256i tiny = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);  // e < 2
  return _mm256_castsi256_ps(_mm256_blendv_epi8(tiny, normal, _mm256_cmpgt_epi32(e, _mm256_set1_epi32(1))));
}
#endif

// The same tile for Q4_0 and Q4_1 on AVX2 without VNNI (the nibbles are the unsigned operand
// as they are: Q4_0's -8 d and Q4_1's m come back per block as the offset against xs), the
// kind a template argument (QT: kMXFP4, kQ4_0, kQ4_1). SmolLM2-135M's 30 layers of Q4_1
// linears, 2 threads, against the per-block int8 tile it replaced (and the float32 tile): M = 1
// 7.8 -> 6.6 ms (7.8), M = 8 29.2 -> 22.3 (18.8), M = 32 101 -> 78 (66). On Zen 2 the float
// tile still wins from 4 rows (vpmaddubsw and vpmaddwd share one pipe; the FMAs have two), so
// `auto` keeps the default model on float32 activations.
template <int64_t QT, int NR, int MT>
void qlinear_tile_pairs_i8(const QWeight& w, int64_t n, const QAct& a, int64_t i0, float* out,
                           int64_t ldo) {
  constexpr bool mx = QT == kMXFP4;
  constexpr float kOffset = mx ? -12.0f : QT == kQ4_0 ? -8.0f : 0.0f;  // times the block's scale
  const int64_t row = w.qs_row(), nb = w.nb, ng = nb / 8;
  const uint8_t* q0 = w.qs + n * row;
  const uint8_t* e0 = mx ? w.ks + n * nb : nullptr;
  const uint16_t* d0 = mx ? nullptr : w.d + n * nb;
  const uint16_t* m0 = QT == kQ4_1 ? w.m + n * nb : nullptr;
  float tail[NR][MT] = {};
  int64_t b0 = 0;
#if defined(__AVX2__)
  const __m256i lut = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(kE2M1Plus12)));
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const __m256i order = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  __m256 acc[NR][MT];
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < MT; ++i) acc[r][i] = _mm256_setzero_ps();
  const int64_t ahead = ahead_rows(row);
  for (int64_t g = 0; g < ng; ++g) {
    for (int r = 0; r < NR; ++r) {
      const uint8_t* qr = q0 + r * row + g * 128;
      _mm_prefetch(reinterpret_cast<const char*>(qr + ahead * row), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(qr + ahead * row + 64), _MM_HINT_T1);
      __m256 scale, mins = _mm256_setzero_ps();
      if constexpr (mx) {
        scale = e8m0_half8(_mm256_permutevar8x32_epi32(_mm256_cvtepu8_epi32(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(e0 + r * nb + 8 * g))), order));
      } else {
        scale = _mm256_permutevar8x32_ps(load_half8(d0 + r * nb + 8 * g), order);
        if constexpr (QT == kQ4_1) mins = _mm256_permutevar8x32_ps(load_half8(m0 + r * nb + 8 * g), order);
      }
      __m256i half[MT];
      for (int h = 0; h < 2; ++h) {  // pairs 2h, 2h + 1
        __m256i lo[2], hi[2];
        for (int k = 0; k < 2; ++k) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qr + 64 * h + 32 * k));
          lo[k] = _mm256_and_si256(v, low4);
          hi[k] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
          if constexpr (mx) {
            lo[k] = _mm256_shuffle_epi8(lut, lo[k]);
            hi[k] = _mm256_shuffle_epi8(lut, hi[k]);
          }
        }
        for (int i = 0; i < MT; ++i) {
          const int8_t* xp = a.q + (i0 + i) * a.stride + (8 * g + 4 * h) * 32;
          __m256i p[2];
          for (int k = 0; k < 2; ++k)
            p[k] = _mm256_madd_epi16(_mm256_add_epi16(
                _mm256_maddubs_epi16(lo[k], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + 64 * k))),
                _mm256_maddubs_epi16(hi[k], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + 64 * k + 32)))), ones);
          const __m256i pp = _mm256_hadd_epi32(p[0], p[1]);
          half[i] = h == 0 ? pp : _mm256_hadd_epi32(half[i], pp);
        }
      }
      for (int i = 0; i < MT; ++i) {  // per block: scale (dx sum(q qx) + kOffset xs) + m xs
        // (the group's dx and xs = dx sum(qx) reordered here, not held: MT = 4 spilled)
        const int64_t at = (i0 + i) * nb + 8 * g;
        const __m256 dx = _mm256_permutevar8x32_ps(_mm256_loadu_ps(a.dx + at), order);
        const __m256 xs = _mm256_permutevar8x32_ps(_mm256_loadu_ps(a.xs + at), order);
        __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(half[i]), dx);
        if constexpr (kOffset != 0.0f) v = _mm256_fmadd_ps(_mm256_set1_ps(kOffset), xs, v);
        acc[r][i] = _mm256_fmadd_ps(scale, v, acc[r][i]);
        if constexpr (QT == kQ4_1) acc[r][i] = _mm256_fmadd_ps(mins, xs, acc[r][i]);
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < MT; ++i) tail[r][i] = reduce_add8(acc[r][i]);
  b0 = 8 * ng;
#endif
  for (int r = 0; r < NR; ++r)  // the blocks after the last whole 8, one at a time
    for (int i = 0; i < MT; ++i) {
      float t = 0;
      for (int64_t b = b0; b < nb; ++b) {
        const uint8_t* q = q0 + r * row + b * 16;
        const int8_t* x = a.q + (i0 + i) * a.stride;
        const float scale = mx ? e8m0_half(e0[r * nb + b]) : _cvtsh_ss(d0[r * nb + b]);
        const float dx = a.dx[(i0 + i) * nb + b], xs = a.xs[(i0 + i) * nb + b];
        int32_t s = 0;
#if defined(__AVX2__)
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q)), m4 = _mm_set1_epi8(0x0F);
        __m128i lo = _mm_and_si128(v, m4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), m4);
        if constexpr (mx) {
          const __m128i lut4 = _mm_load_si128(reinterpret_cast<const __m128i*>(kE2M1Plus12));
          lo = _mm_shuffle_epi8(lut4, lo);
          hi = _mm_shuffle_epi8(lut4, hi);
        }
        const __m128i p = _mm_madd_epi16(_mm_add_epi16(
            _mm_maddubs_epi16(lo, _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + pairs_index(b, 0)))),
            _mm_maddubs_epi16(hi, _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + pairs_index(b, 16))))),
            _mm_set1_epi16(1));
        const __m128i p2 = _mm_add_epi32(p, _mm_unpackhi_epi64(p, p));
        s = _mm_cvtsi128_si32(_mm_add_epi32(p2, _mm_shuffle_epi32(p2, 1)));
#else
        for (int j = 0; j < 16; ++j) {
          const int lo = q[j] & 0xF, hi = q[j] >> 4;
          s += (mx ? kE2M1Plus12[lo] : lo) * x[pairs_index(b, j)] +
               (mx ? kE2M1Plus12[hi] : hi) * x[pairs_index(b, j + 16)];
        }
#endif
        t += scale * (dx * static_cast<float>(s) + kOffset * xs);
        if constexpr (QT == kQ4_1) t += _cvtsh_ss(m0[r * nb + b]) * xs;
      }
      out[i * ldo + r] = tail[r][i] + t;
    }
}


// Whether Q4_K and Q6_K meet 8-bit activations in whole super-blocks (the AVX2 tiles without
// VNNI): then each 256 elements of x share one scale. Elsewhere Q6_K takes float32 activations.
#if defined(__AVX2__) && !defined(__AVX512VNNI__)
constexpr bool kKQuantSuperblock = true;
#else
constexpr bool kKQuantSuperblock = false;
#endif
bool kquant_superblock_act() { return kKQuantSuperblock; }

// Whether this build runs Q4_0 / Q4_1 through qlinear_tile_pairs_i8 (AVX2 without VNNI; the
// VNNI builds have their quad tiles): x then takes the kQ4Pairs order.
constexpr bool kQ4PairsTile = kKQuantSuperblock;

template <int64_t QT, int NR>
void pairs_rows_i8(const QWeight& w, int64_t n, const QAct& a, float* out) {
  constexpr int TR = NR % 2 == 0 ? 2 : NR;
  int64_t i = 0;
  for (; i + 4 <= a.M; i += 4)  // 1 weight row x 4 x rows; 2 x 1 (AVX2's 16 registers)
    for (int r = 0; r < NR; ++r)
      qlinear_tile_pairs_i8<QT, 1, 4>(w, n + r, a, i, out + i * w.N + n + r, w.N);
  for (; i < a.M; ++i)
    for (int r = 0; r < NR; r += TR)
      qlinear_tile_pairs_i8<QT, TR, 1>(w, n + r, a, i, out + i * w.N + n + r, w.N);
}

template <int NR>
void qlinear_rows_i8(const QWeight& w, int64_t n, const QAct& a, float* out) {
#if defined(__AVX2__)
  prefetch_weight_rows(w, n, NR, /*rows=*/false);  // the tiles ask for the rows (kAheadRows)
#else
  prefetch_weight_rows(w, n, NR, /*rows=*/true);
#endif
  // the pairs tiles (every build's MXFP4, Q4_0 / Q4_1 where kQ4PairsTile) read the rows' own
  // scales
  if (w.qtype == kMXFP4) return pairs_rows_i8<kMXFP4, NR>(w, n, a, out);
  if (kQ4PairsTile && w.qtype == kQ4_0) return pairs_rows_i8<kQ4_0, NR>(w, n, a, out);
  if (kQ4PairsTile && w.qtype == kQ4_1) return pairs_rows_i8<kQ4_1, NR>(w, n, a, out);
  thread_local std::vector<float> scales;
  scales.resize(2 * NR * w.nb);
  float* sd = scales.data();
  float* sm = sd + NR * w.nb;
  // the AVX2 K-quant tiles read the rows' own scales
  if (!((w.qtype == kQ4_K || w.qtype == kQ6_K) && kquant_superblock_act())) row_scales(w, n, NR, sd, sm);
  // AVX2's 16 registers hold 2 weight rows x 4 x rows of accumulators and the 4 x rows, not 4 x 4
  // (one SmolLM2-135M step's linears, 2 threads: M = 4 15.0 -> 13.6 ms, M = 8 25.3 -> 23.2).
#if defined(__AVX2__) && !defined(__AVX512F__)
  constexpr int TR = NR % 2 == 0 ? 2 : NR;
#else
  constexpr int TR = NR;
#endif
  int64_t i = 0;
  for (; i + 4 <= a.M; i += 4)
    for (int r = 0; r < NR; r += TR)
      qlinear_tile_i8<TR, 4>(w, n + r, sd + r * w.nb, sm + r * w.nb, a, i,
                             out + i * w.N + n + r, w.N);
  // Q4_K one x row at a time: 2 weight rows per tile too (4 rows' scales and sums spill AVX2's
  // registers; in-cache [2048, 4096] on 1 thread 18.1 -> 20.0 GB/s of blocks)
  if (w.qtype == kQ4_K && TR != NR) {
    for (; i < a.M; ++i)
      for (int r = 0; r < NR; r += TR)
        qlinear_tile_i8<TR, 1>(w, n + r, sd + r * w.nb, sm + r * w.nb, a, i,
                               out + i * w.N + n + r, w.N);
    return;
  }
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
// The layout qlinear's tiles read `qtype` weights' 8-bit activations in.
int act_layout(int64_t qtype) {
  const bool q4 = qtype == kQ4_0 || qtype == kQ4_1;
  return qtype == kMXFP4 || (kQ4PairsTile && q4)    ? kQ4Pairs
         : has_vnni() && qtype != kQ8_0             ? kQ4Quads
         : qtype == kQ4_K && kquant_superblock_act() ? kQ4Pairs
                                                     : kNatural;
}

QAct quantize_act(const float* x, int64_t M, int64_t K, int64_t qtype, std::vector<int8_t>& q,
                  std::vector<float>& sc, int64_t& dxe_row) {
  const bool superblock = (qtype == kQ4_K || qtype == kQ6_K) && kquant_superblock_act();
  const int layout = act_layout(qtype);
  const int64_t nb = K / kQK, stride = act_stride(layout, nb), G = act_group(layout);
  dxe_row = (nb + G - 1) / G * 16;
  q.resize(M * stride);
  sc.resize(M * nb * 2 + M * dxe_row);
  float* dx = sc.data();
  quantize_rows(x, M, K, layout, q.data(), dx, dx + M * nb, dx + 2 * M * nb,
                superblock ? kQK_K : kQK);
  return QAct{M, nb, stride, q.data(), dx, dx + M * nb, dx + 2 * M * nb};
}
