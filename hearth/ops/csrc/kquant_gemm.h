// The AVX2 K-quant GEMMs (Q4_K, Q6_K x 8-bit activations) of prompt steps: qlinear_q4k_gemm,
// qlinear_q6k_gemm and their weight-panel repacks (moe.h runs experts through them too).
//
// A fragment of hearth's one kernel build: included by cpu_kernels.cpp inside
// namespace hearth::(anonymous), after qlinear_a8.h (QAct, the activation layouts, act_rows).

// Q4_K x 8-bit activations for many rows (a prompt step) on AVX2 without VNNI: an M-blocked
// GEMM. The tiles above unpack a weight row's nibbles and pick its scales again for every 4
// activation rows, and apply each 32-block's scale with its own vpmaddwd (2 vpmaddubsw + 1
// vpmaddwd per 64 products, the integer multiplies that bound Zen 2's one multiply pipe). Here
// a task's panel of weight rows is unpacked once (q4k_repack_row: one byte per weight, each
// super-block as 8 runs of 32 bytes where run t holds elements 4t..4t+3 of each of the 8
// blocks, so int16 lane j of a vpmaddubsw belongs to block j / 2 in every run) and used by all
// of the step's rows. A super-block's 8 vpmaddubsw sums then add up in int16 lanes (|.| <= 8 *
// 2 * 15 * 127 = 30480, no saturation) and meet the 8 scales in one vpmaddwd (9 multiplies per
// 256 products instead of 12); the activations take the same order (kQ4KPanel, one scale per
// super-block as for the tiles). Per super-block and (weight row, activation row) one float FMA
// applies d dx, and one more the mins' term (-dmin mn against each block's dx sum(qx), the
// tiles' offset_term). The integer sums are the tiles' exactly; only float summation order
// differs.
#if defined(__AVX2__) && !defined(__AVX512VNNI__)
constexpr bool kKQuantGemm = true;
// A weight row's Q4_K super-blocks -> `q` (K bytes, the kQ4KPanel order), `sc` (per super-block
// 16 int16: scale b in lanes 2b, 2b + 1), `mn` (per super-block 8 floats: -dmin mn_b), `d`.
inline void q4k_repack_row(const QWeight& w, int64_t n, uint8_t* q, int16_t* sc, float* mn,
                           float* d) {
  const int64_t ns = w.nb / 8;
  const uint8_t* qs = w.qs + n * (w.K / 2);
  const uint16_t* dd = w.d + n * w.d_row();
  const uint8_t* ks = w.ks + n * w.nb * 2;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i pairs = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t s = 0; s < ns; ++s) {
    // A 32-byte load holds blocks 2k, 2k + 1 (16 bytes each: element j low, j + 16 high); as
    // dwords, lo[4h + t] = elements 4t..4t+3 of block 2k + h. vpermd pairs the two blocks' dword
    // t into qword t, and a 4x4 qword transpose gathers qword t of the 4 loads into run t.
    __m256i lo[4], hi[4];
    for (int k = 0; k < 4; ++k) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + s * 128 + 32 * k));
      lo[k] = _mm256_permutevar8x32_epi32(_mm256_and_si256(v, low4), pairs);
      hi[k] = _mm256_permutevar8x32_epi32(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4), pairs);
    }
    uint8_t* out = q + s * 256;
    for (int half = 0; half < 2; ++half) {
      const __m256i* P = half ? hi : lo;
      const __m256i A = _mm256_unpacklo_epi64(P[0], P[1]), B = _mm256_unpackhi_epi64(P[0], P[1]);
      const __m256i C = _mm256_unpacklo_epi64(P[2], P[3]), D = _mm256_unpackhi_epi64(P[2], P[3]);
      __m256i* o = reinterpret_cast<__m256i*>(out + half * 128);
      _mm256_storeu_si256(o + 0, _mm256_permute2x128_si256(A, C, 0x20));
      _mm256_storeu_si256(o + 1, _mm256_permute2x128_si256(B, D, 0x20));
      _mm256_storeu_si256(o + 2, _mm256_permute2x128_si256(A, C, 0x31));
      _mm256_storeu_si256(o + 3, _mm256_permute2x128_si256(B, D, 0x31));
    }
    const __m256i s32 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(ks + 16 * s)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(sc + 16 * s),
                        _mm256_or_si256(s32, _mm256_slli_epi32(s32, 16)));
    const __m256 m32 = _mm256_cvtepi32_ps(
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(ks + 16 * s + 8))));
    _mm256_storeu_ps(mn + 8 * s, _mm256_mul_ps(_mm256_set1_ps(-_cvtsh_ss(dd[2 * s + 1])), m32));
    d[s] = _cvtsh_ss(dd[2 * s]);
  }
}

// TR weight rows of a repacked panel x MT activation rows from i0, over all of K.
template <int TR, int MT>
void q4k_gemm_tile(const uint8_t* q, const int16_t* sc, const float* mn, const float* d,
                   int64_t ns, const QAct& a, int64_t i0, float* out, int64_t ldo) {
  const int64_t K = ns * 256, nb = a.nb;
  __m256 facc[TR][MT];
  for (int r = 0; r < TR; ++r)
    for (int i = 0; i < MT; ++i) facc[r][i] = _mm256_setzero_ps();
  for (int64_t s = 0; s < ns; ++s) {
    __m256i acc[TR][MT];
    for (int r = 0; r < TR; ++r)
      for (int i = 0; i < MT; ++i) acc[r][i] = _mm256_setzero_si256();
    for (int t = 0; t < 8; ++t) {
      __m256i wv[TR];
      for (int r = 0; r < TR; ++r)
        wv[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + r * K + s * 256 + 32 * t));
      for (int i = 0; i < MT; ++i) {
        const __m256i xv = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(a.q + (i0 + i) * a.stride + s * 256 + 32 * t));
        for (int r = 0; r < TR; ++r)
          acc[r][i] = _mm256_add_epi16(acc[r][i], _mm256_maddubs_epi16(wv[r], xv));
      }
    }
    for (int i = 0; i < MT; ++i) {
      const float dx = a.dx[(i0 + i) * nb + 8 * s];
      const __m256 xs = _mm256_loadu_ps(a.xs + (i0 + i) * nb + 8 * s);
      for (int r = 0; r < TR; ++r) {
        const __m256i scl = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + (r * ns + s) * 16));
        const __m256 v = _mm256_cvtepi32_ps(_mm256_madd_epi16(acc[r][i], scl));
        facc[r][i] = _mm256_fmadd_ps(v, _mm256_set1_ps(d[r * ns + s] * dx), facc[r][i]);
        facc[r][i] = _mm256_fmadd_ps(_mm256_loadu_ps(mn + (r * ns + s) * 8), xs, facc[r][i]);
      }
    }
  }
  for (int r = 0; r < TR; ++r)
    for (int i = 0; i < MT; ++i) out[i * ldo + r] = reduce_add8(facc[r][i]);
}

template <int TR>
void q4k_gemm_rows(const uint8_t* q, const int16_t* sc, const float* mn, const float* d,
                   int64_t ns, const QAct& a, float* out, int64_t ldo) {
  constexpr int MT = 6;
  int64_t i = 0;
  for (; i + MT <= a.M; i += MT) q4k_gemm_tile<TR, MT>(q, sc, mn, d, ns, a, i, out + i * ldo, ldo);
  switch (a.M - i) {
    case 5: q4k_gemm_tile<TR, 5>(q, sc, mn, d, ns, a, i, out + i * ldo, ldo); break;
    case 4: q4k_gemm_tile<TR, 4>(q, sc, mn, d, ns, a, i, out + i * ldo, ldo); break;
    case 3: q4k_gemm_tile<TR, 3>(q, sc, mn, d, ns, a, i, out + i * ldo, ldo); break;
    case 2: q4k_gemm_tile<TR, 2>(q, sc, mn, d, ns, a, i, out + i * ldo, ldo); break;
    case 1: q4k_gemm_tile<TR, 1>(q, sc, mn, d, ns, a, i, out + i * ldo, ldo); break;
    default: break;
  }
}

// The GEMMs' activation rows go in blocks of ~96 KB, each swept by every weight-row pair of the
// task's panel while it sits in L2: streaming all M rows past each pair read them from L3. One
// thread, M = 512: Q4_K [14336, 4096] 92.8 -> 121.6 GOPS, [4096, 14336] 101.6 -> 121.1 (M = 64
// unchanged: it fit already).
inline int64_t kq_act_block(int64_t K) { return std::max<int64_t>(12, int64_t{98304} / K / 12 * 12); }

// Weight rows [n0, n1) of x (quantized in the kQ4KPanel order) times a Q4_K weight: the panel
// unpacked into this thread's buffers, then every activation row against it.
void qlinear_q4k_gemm(const QWeight& w, int64_t n0, int64_t n1, const QAct& a, float* out) {
  const int64_t ns = w.nb / 8, rows = n1 - n0;
  thread_local std::vector<uint8_t> q;
  thread_local std::vector<int16_t> sc;
  thread_local std::vector<float> f;
  q.resize(rows * w.K);
  sc.resize(rows * ns * 16);
  f.resize(rows * ns * 9);
  float* mn = f.data();
  float* d = mn + rows * ns * 8;
  for (int64_t r = 0; r < rows; ++r)
    q4k_repack_row(w, n0 + r, q.data() + r * w.K, sc.data() + r * ns * 16, mn + r * ns * 8, d + r * ns);
  constexpr int TR = 2;
  const int64_t block = kq_act_block(w.K);
  for (int64_t i0 = 0; i0 < a.M; i0 += block) {
    const int64_t m = std::min(block, a.M - i0);
    const QAct ab = act_rows(a, i0, m, 0);  // (the GEMMs read no dxe)
    float* o = out + i0 * w.N + n0;
    int64_t r = 0;
    for (; r + TR <= rows; r += TR)
      q4k_gemm_rows<TR>(q.data() + r * w.K, sc.data() + r * ns * 16, mn + r * ns * 8, d + r * ns,
                        ns, ab, o + r, w.N);
    if (r < rows)
      q4k_gemm_rows<1>(q.data() + r * w.K, sc.data() + r * ns * 16, mn + r * ns * 8, d + r * ns,
                       ns, ab, o + r, w.N);
  }
}

// Q6_K the same way: the panel's weights as unsigned q + 32 (0..63, so no vpsignb per pair of
// rows), each super-block as 8 runs of 32 bytes where run t holds elements 2t, 2t + 1 of each of
// the 16 groups of 16 (group g at bytes 2g, 2g + 1: int16 lane g of a vpmaddubsw). Two runs'
// vpmaddubsw sums add up in int16 (|.| <= 2 * 2 * 63 * 127 = 32004) and meet the 16 int8 scales
// in one vpmaddwd: 8 + 4 multiplies per 256 products, and one more vpmaddwd for the offset,
// 32 sum_g sc_g X_g with X_g each group's sum of x (q6k_group_sums).
inline void q6k_repack_row(const QWeight& w, int64_t n, uint8_t* q, int16_t* sc, float* d) {
  const int64_t ns = w.nb / 8;
  const uint8_t* qs = w.qs + n * w.K;
  const uint16_t* dd = w.d + n * w.d_row();
  const int8_t* ks = reinterpret_cast<const int8_t*>(w.ks) + n * w.nb * 2;
  const __m256i off = _mm256_set1_epi8(32);
  for (int64_t s = 0; s < ns; ++s) {
    // rows g = [group g | group g + 8] as 8 int16 words each; an 8x8 word transpose in both
    // 128-bit lanes makes run t = word t of groups 0-7 | of groups 8-15
    const uint8_t* src = qs + s * 256;
    __m256i R[8];
    for (int g = 0; g < 8; ++g)
      R[g] = _mm256_add_epi8(_mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(src + 16 * (g + 8)),
                                                 reinterpret_cast<const __m128i*>(src + 16 * g)), off);
    __m256i a[8], b[8];
    for (int g = 0; g < 4; ++g) {
      a[2 * g] = _mm256_unpacklo_epi16(R[2 * g], R[2 * g + 1]);
      a[2 * g + 1] = _mm256_unpackhi_epi16(R[2 * g], R[2 * g + 1]);
    }
    // a[2g + h]: dwords = (word j of rows 2g, 2g + 1) for j = 4h..4h+3
    for (int p = 0; p < 2; ++p)
      for (int h = 0; h < 2; ++h) {
        b[4 * p + 2 * h] = _mm256_unpacklo_epi32(a[4 * p + h], a[4 * p + 2 + h]);
        b[4 * p + 2 * h + 1] = _mm256_unpackhi_epi32(a[4 * p + h], a[4 * p + 2 + h]);
      }
    // b[4p + 2h + e]: qwords = (word j of rows 4p..4p+3) for j = 4h + 2e, 4h + 2e + 1
    uint8_t* out = q + s * 256;
    for (int h = 0; h < 2; ++h)
      for (int e = 0; e < 2; ++e) {
        const int j = 4 * h + 2 * e;
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * j),
                            _mm256_unpacklo_epi64(b[2 * h + e], b[4 + 2 * h + e]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * (j + 1)),
                            _mm256_unpackhi_epi64(b[2 * h + e], b[4 + 2 * h + e]));
      }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(sc + 16 * s),
                        _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ks + 16 * s))));
    d[s] = _cvtsh_ss(dd[s]);
  }
}

// Each activation row's per-super-block group sums X_g (16 int16; the kQ6KPanel order).
inline void q6k_group_sums(const QAct& a, int64_t ns, int16_t* X) {
  const __m256i ones = _mm256_set1_epi8(1);
  for (int64_t i = 0; i < a.M; ++i)
    for (int64_t s = 0; s < ns; ++s) {
      __m256i acc = _mm256_setzero_si256();
      for (int t = 0; t < 8; ++t)
        acc = _mm256_add_epi16(acc, _mm256_maddubs_epi16(ones, _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(a.q + i * a.stride + s * 256 + 32 * t))));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(X + (i * ns + s) * 16), acc);
    }
}

template <int TR, int MT>
void q6k_gemm_tile(const uint8_t* q, const int16_t* sc, const float* d, const int16_t* X,
                   int64_t ns, const QAct& a, int64_t i0, float* out, int64_t ldo) {
  const int64_t K = ns * 256, nb = a.nb;
  __m256 facc[TR][MT];
  for (int r = 0; r < TR; ++r)
    for (int i = 0; i < MT; ++i) facc[r][i] = _mm256_setzero_ps();
  for (int64_t s = 0; s < ns; ++s) {
    __m256i acc[TR][MT], scl[TR];
    for (int r = 0; r < TR; ++r) {
      scl[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + (r * ns + s) * 16));
      for (int i = 0; i < MT; ++i) acc[r][i] = _mm256_setzero_si256();
    }
    for (int t = 0; t < 8; t += 2) {
      __m256i w0[TR], w1[TR];
      for (int r = 0; r < TR; ++r) {
        w0[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + r * K + s * 256 + 32 * t));
        w1[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + r * K + s * 256 + 32 * t + 32));
      }
      for (int i = 0; i < MT; ++i) {
        const int8_t* xp = a.q + (i0 + i) * a.stride + s * 256 + 32 * t;
        const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp));
        const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + 32));
        for (int r = 0; r < TR; ++r)
          acc[r][i] = _mm256_add_epi32(acc[r][i], _mm256_madd_epi16(_mm256_add_epi16(
              _mm256_maddubs_epi16(w0[r], x0), _mm256_maddubs_epi16(w1[r], x1)), scl[r]));
      }
    }
    for (int i = 0; i < MT; ++i) {
      const float dx = a.dx[(i0 + i) * nb + 8 * s];
      const __m256i xg = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(X + ((i0 + i) * ns + s) * 16));
      for (int r = 0; r < TR; ++r) {
        const __m256i isum = _mm256_sub_epi32(acc[r][i], _mm256_slli_epi32(_mm256_madd_epi16(xg, scl[r]), 5));
        facc[r][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(d[r * ns + s] * dx), facc[r][i]);
      }
    }
  }
  for (int r = 0; r < TR; ++r)
    for (int i = 0; i < MT; ++i) out[i * ldo + r] = reduce_add8(facc[r][i]);
}

template <int TR>
void q6k_gemm_rows(const uint8_t* q, const int16_t* sc, const float* d, const int16_t* X,
                   int64_t ns, const QAct& a, float* out, int64_t ldo) {
  constexpr int MT = 4;
  int64_t i = 0;
  for (; i + MT <= a.M; i += MT) q6k_gemm_tile<TR, MT>(q, sc, d, X, ns, a, i, out + i * ldo, ldo);
  switch (a.M - i) {
    case 3: q6k_gemm_tile<TR, 3>(q, sc, d, X, ns, a, i, out + i * ldo, ldo); break;
    case 2: q6k_gemm_tile<TR, 2>(q, sc, d, X, ns, a, i, out + i * ldo, ldo); break;
    case 1: q6k_gemm_tile<TR, 1>(q, sc, d, X, ns, a, i, out + i * ldo, ldo); break;
    default: break;
  }
}

void qlinear_q6k_gemm(const QWeight& w, int64_t n0, int64_t n1, const QAct& a, const int16_t* X,
                      float* out) {
  const int64_t ns = w.nb / 8, rows = n1 - n0;
  thread_local std::vector<uint8_t> q;
  thread_local std::vector<int16_t> sc;
  thread_local std::vector<float> d;
  q.resize(rows * w.K);
  sc.resize(rows * ns * 16);
  d.resize(rows * ns);
  for (int64_t r = 0; r < rows; ++r)
    q6k_repack_row(w, n0 + r, q.data() + r * w.K, sc.data() + r * ns * 16, d.data() + r * ns);
  constexpr int TR = 2;
  const int64_t block = kq_act_block(w.K);  // as qlinear_q4k_gemm
  for (int64_t i0 = 0; i0 < a.M; i0 += block) {
    const int64_t m = std::min(block, a.M - i0);
    const QAct ab = act_rows(a, i0, m, 0);  // (the GEMMs read no dxe)
    const int16_t* xb = X + i0 * ns * 16;
    float* o = out + i0 * w.N + n0;
    int64_t r = 0;
    for (; r + TR <= rows; r += TR)
      q6k_gemm_rows<TR>(q.data() + r * w.K, sc.data() + r * ns * 16, d.data() + r * ns, xb, ns,
                        ab, o + r, w.N);
    if (r < rows)
      q6k_gemm_rows<1>(q.data() + r * w.K, sc.data() + r * ns * 16, d.data() + r * ns, xb, ns,
                       ab, o + r, w.N);
  }
}
#else
constexpr bool kKQuantGemm = false;
void qlinear_q4k_gemm(const QWeight&, int64_t, int64_t, const QAct&, float*) {}
void q6k_group_sums(const QAct&, int64_t, int16_t*) {}
void qlinear_q6k_gemm(const QWeight&, int64_t, int64_t, const QAct&, const int16_t*, float*) {}
#endif
