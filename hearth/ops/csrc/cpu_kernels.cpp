// hearth's CPU kernels: the ops a decode step spends its time in, fused so a step makes one pass
// over memory per op instead of one per torch call.
//
//   qlinear          y = x W^T with W kept in ggml block formats (Q8_0, Q4_0, Q4_1): weights are
//                    dequantized in registers; activations stay float32 (exact), or with
//                    int8_act are quantized to 8 bits per 32-block and the dot products are
//                    integer (VNNI). A batch-1 step is bound by reading weights, so 4.5-8.5 bits
//                    per weight instead of 32 is the speed-up.
//   decode_attention short queries (1..16 new tokens per request: decodes, verify steps),
//                    causal among them, over the paged cache read in place through the block
//                    table (no gather), split along the context for parallelism, cache in
//                    float32, bfloat16, or int8 / fp8 (e4m3) rows with a float32 scale each
//                    (kv_quant.py).
//   prefill_attention a prefill chunk (causal, after any cached prefix) over the paged cache in
//                    place: flash-style tiles, the query heads of a kv head together.
//   rms_norm, add_rms_norm, silu_mul, rope_write_kv, qk_norm_rope_write_kv: elementwise passes,
//                    fused.
//   decode_layer     a whole decoder layer for a step of short queries.
//   moe_experts      a Mixture-of-Experts layer's experts (moe.h): pairs sorted by expert, only
//                    the active experts' weights read, quantized for few-row steps.
//
// The same source is compiled three times by hearth/ops/build_kernels.py: AVX-512 + VNNI
// (-mavx512f/bw/vl/dq -mavx512vnni), AVX-512 and AVX2; the loader picks the best build this CPU
// runs (probed in a subprocess, so a CPU that lists a feature it cannot execute falls back
// instead of dying). The weight loops and attention rows have hand-written AVX-512; everything
// else is plain loops the compiler vectorizes (`#pragma omp simd`) for any target.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

namespace hearth {
namespace {

constexpr int64_t kQK = 32;  // elements per ggml block
// ggml type ids
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;

inline float bf16_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even (as torch's .to(bfloat16))
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  // A select, not a branch, so loops over it vectorize; NaN stays a (quiet) NaN.
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? ((u >> 16) | 0x40u) : rounded);
}

// exp(x) for x <= 0 (softmax after max subtraction) and moderate positive x: 2^n * p(f),
// a degree-6 polynomial on [-0.5, 0.5] in log2 units (relative error ~2e-7). Plain float and
// integer ops so `omp simd` loops vectorize it.
inline float fast_exp(float x) {
  x = std::max(x, -87.0f);
  x = std::min(x, 88.0f);
  const float y = x * 1.44269504088896341f;
  const float n = std::nearbyint(y);
  const float f = (y - n) * 0.69314718055994531f;
  float p = 1.0f / 720.0f;
  p = p * f + 1.0f / 120.0f;
  p = p * f + 1.0f / 24.0f;
  p = p * f + 1.0f / 6.0f;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  p = p * f + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

// Run f(0..n-1) on torch's OpenMP threads, each thread taking the next task from a shared
// counter. at::parallel_for splits statically, so one thread preempted by another process (the
// HTTP server, a neighbour) stalls the whole op at the barrier; here the other threads take over
// its remaining tasks.
// `threads` <= 1 runs the tasks on the calling thread: no parallel region, so no barrier that a
// preempted thread can hold up (the engine picks this per step when another process competes
// for the cores; hearth/engine/thread_tuner.py).
template <typename F>
void parallel_tasks(int64_t n, const F& f, int64_t threads) {
  if (n <= 1 || threads <= 1 || at::get_num_threads() <= 1 || at::in_parallel_region()) {
    for (int64_t i = 0; i < n; ++i) f(i);
    return;
  }
  std::atomic<int64_t> next{0};
#pragma omp parallel
  {
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < n;
         i = next.fetch_add(1, std::memory_order_relaxed))
      f(i);
  }
}

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
  for (int64_t i = 0; i < count; ++i) {
    sd[i] = _cvtsh_ss(d[i]);
    sm[i] = m ? _cvtsh_ss(m[i]) : (w.qtype == kQ4_0 ? -8.0f * sd[i] : 0.0f);
  }
#endif
}

#if defined(__AVX512F__)
// The tile asks for the same bytes of the weight rows kAheadRows further on, a cache line per
// line it reads, spread through its block loop. A batch-1 engine step, interleaved A/B: 8.3 ->
// 6.95 ms (batch 4: 12.7 -> 11.3, batch 8: 20.1 -> 19.4) against asking for the rows of the
// group 2 groups ahead all at once when a group starts (a burst of ~40 prefetches that fills
// the line-fill buffers and stalls the loads behind it); 16 rows ahead measured the same.
constexpr int64_t kAheadRows = 8;
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
// over one step's weights), and MT <= 8 keeps the 2 * MT accumulators in registers.
template <int NR, int MT>
inline void qlinear_tile_pairs(const QWeight& w, int64_t n, const float* sd, const float* sm,
                               const float* x, float* out) {
  if constexpr (NR % 2 == 0) {
    for (int r = 0; r < NR; r += 2)
      qlinear_tile<2, MT>(w, n + r, sd + r * w.nb, sm + r * w.nb, x, w.K, out + r, w.N);
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
#if defined(__AVX512F__)
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

// ---------------------------------------------------------------------------------------------
// Elementwise fusions.

// Activations are float32, or bfloat16 (`--prefill-dtype bfloat16`: many-row steps keep their
// activations in bf16 between the GEMMs, the residual stream in fp32). Every op below reads and
// writes either; math is always fp32, bf16 outputs are rounded to nearest even.
inline float act_load(const float* p, int64_t j) { return p[j]; }
inline float act_load(const uint16_t* p, int64_t j) { return bf16_to_float(p[j]); }
inline void act_store(float* p, int64_t j, float v) { p[j] = v; }
inline void act_store(uint16_t* p, int64_t j, float v) { p[j] = float_to_bf16(v); }

bool is_bf16(const at::Tensor& t) { return t.scalar_type() == at::kBFloat16; }

void check_act(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || is_bf16(t), what, ": float32 or bfloat16");
}

template <typename T>
T* act_ptr(const at::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

template <typename XT, typename OT>
void rms_row(const XT* x, const float* w, float eps, int64_t D, OT* out) {
  float ss = 0;
#pragma omp simd reduction(+ : ss)
  for (int64_t j = 0; j < D; ++j) {
    const float v = act_load(x, j);
    ss += v * v;
  }
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(D) + eps);
#pragma omp simd
  for (int64_t j = 0; j < D; ++j) act_store(out, j, w[j] * (act_load(x, j) * r));
}

// Call f with (XT*, OT*) typed for x's and the output's dtypes (float or uint16_t = bf16).
template <typename F>
void dispatch_act(const at::Tensor& x, const at::Tensor& out, const F& f) {
  if (is_bf16(x)) {
    if (is_bf16(out)) f(act_ptr<uint16_t>(x), act_ptr<uint16_t>(out));
    else f(act_ptr<uint16_t>(x), act_ptr<float>(out));
  } else {
    if (is_bf16(out)) f(act_ptr<float>(x), act_ptr<uint16_t>(out));
    else f(act_ptr<float>(x), act_ptr<float>(out));
  }
}

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight, double eps,
                    bool bf16_out = false) {
  check_act(x_in, "rms_norm: x");
  TORCH_CHECK(weight.scalar_type() == at::kFloat, "rms_norm: float32 weight");
  const int64_t D = x_in.size(-1);
  at::Tensor x = x_in.reshape({-1, D}).contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(bf16_out ? at::kBFloat16 : at::kFloat));
  const float* wp = weight.data_ptr<float>();
  dispatch_act(x, out, [&](auto* xp, auto* op) {
    at::parallel_for(0, x.size(0), 64, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t)
        rms_row(xp + t * D, wp, static_cast<float>(eps), D, op + t * D);
    });
  });
  return out.view(x_in.sizes());
}

// residual += x (in place; x float32 or bfloat16, residual float32); returns
// rms_norm(residual) * weight, in bfloat16 if bf16_out else float32.
at::Tensor add_rms_norm(const at::Tensor& x_in, at::Tensor& residual, const at::Tensor& weight,
                        double eps, bool bf16_out = false) {
  TORCH_CHECK(residual.is_contiguous() && residual.scalar_type() == at::kFloat, "add_rms_norm: residual");
  check_act(x_in, "add_rms_norm: x");
  const int64_t D = residual.size(-1);
  at::Tensor x = x_in.reshape({-1, D}).contiguous();
  TORCH_CHECK(x.size(0) * D == residual.numel(), "add_rms_norm: x and residual differ in shape");
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(bf16_out ? at::kBFloat16 : at::kFloat));
  float* rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  dispatch_act(x, out, [&](auto* xp, auto* op) {
    at::parallel_for(0, x.size(0), 64, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        float* r = rp + t * D;
        const auto* xr = xp + t * D;
#pragma omp simd
        for (int64_t j = 0; j < D; ++j) r[j] = r[j] + act_load(xr, j);
        rms_row(r, wp, static_cast<float>(eps), D, op + t * D);
      }
    });
  });
  return out.view(residual.sizes());
}

// [T, 2I] (gate | up) -> [T, I]: silu(gate) * up, in gate_up's dtype.
at::Tensor silu_mul(const at::Tensor& gate_up_in) {
  at::Tensor gu = gate_up_in.contiguous();
  check_act(gu, "silu_mul");
  const int64_t T = gu.size(0), I = gu.size(1) / 2;
  at::Tensor out = at::empty({T, I}, gu.options());
  dispatch_act(gu, out, [&](auto* gp, auto* op) {
    at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const auto* g = gp + t * 2 * I;
        const auto* u = g + I;
        auto* o = op + t * I;
#pragma omp simd
        for (int64_t j = 0; j < I; ++j) {
          const float gj = act_load(g, j);
          act_store(o, j, gj / (1.0f + fast_exp(-gj)) * act_load(u, j));
        }
      }
    });
  });
  return out;
}

// The scaled KV formats (hearth/ops/kv_quant.py): a row of one token and KV head is D 8-bit
// values -- int8, or fp8 e4m3 bytes -- followed by the 4 bytes of its float32 scale, so rows lie
// D + 4 elements apart and value j is q[j] * scale. Readers widen q in registers and put the
// scale on the score (K) or on the probability (V), never on the D values.
constexpr int64_t kScaleBytes = 4;
struct e4m3 {  // one fp8 e4m3 ("fn": no infinities) byte: sign, 4 exponent bits (bias 7), 3 mantissa
  uint8_t bits;
};
template <typename KV>
constexpr bool is_q8 = std::is_same_v<KV, int8_t>;
template <typename KV>
constexpr bool is_fp8 = std::is_same_v<KV, e4m3>;
template <typename KV>
constexpr bool scaled_rows = is_q8<KV> || is_fp8<KV>;
template <typename KV>
constexpr int64_t row_stride(int64_t D) { return scaled_rows<KV> ? D + kScaleBytes : D; }

// e4m3 -> float goes through fp16: the byte's exponent and mantissa moved into an fp16's
// (x & 0x7F) << 7, sign to bit 15, is the value / 256 exactly, subnormals included (fp16's
// exponent bias is 8 more than e4m3's), and vcvtph2ps / F16C widen it in one instruction. The
// readers take that 1/256 back on the row's scale (row_scale), so widening costs no multiply.
constexpr float kFp8Unit = 256.0f;
inline uint16_t e4m3_half_bits(uint8_t b) {
  return static_cast<uint16_t>(((b & 0x7F) << 7) | ((b & 0x80) << 8));
}

template <typename KV>
inline float row_scale(const KV* row, int64_t D) {
  if constexpr (scaled_rows<KV>) {
    float s;
    std::memcpy(&s, row + D, sizeof(float));
    return is_fp8<KV> ? s * kFp8Unit : s;  // (a power of two: exact)
  } else {
    return 1.0f;
  }
}

// float -> e4m3, rounded to nearest even, for |f| <= 448 (the format's largest value): the same
// bytes as torch's .to(torch.float8_e4m3fn). Below 2^-6 (e4m3's smallest normal) the steps are
// 2^-9: adding 2^14, whose float32 ulp is 2^-9, rounds there in hardware. Above, the float32
// mantissa is rounded to its top 3 bits (half to even) and the exponent rebiased (127 -> 7).
inline uint8_t float_to_e4m3(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80);
  bits &= 0x7FFFFFFFu;
  if (bits < (121u << 23)) {
    float a, sum;
    std::memcpy(&a, &bits, 4);
    sum = a + 16384.0f;
    uint32_t sb;
    std::memcpy(&sb, &sum, 4);
    return sign | static_cast<uint8_t>(sb - (141u << 23));
  }
  const uint32_t odd = (bits >> 20) & 1;
  bits += (static_cast<uint32_t>(7 - 127) << 23) + 0x7FFFFu + odd;
  return sign | static_cast<uint8_t>(bits >> 20);
}

bool is_fp8_cache(const at::Tensor& t) { return t.scalar_type() == at::kFloat8_e4m3fn; }
bool is_scaled_cache(const at::Tensor& t) { return t.scalar_type() == at::kChar || is_fp8_cache(t); }

// One K or V row of D values into a scaled KV format: scale = max|x| / 127 (int8) or / 448
// (fp8), q = x / scale rounded half to even -- float32 division, exactly as
// hearth/ops/kv_quant.py quantizes, so the fused write and the torch path store the same bytes.
template <typename KV, typename AT>
inline void quantize_kv_row(const AT* x, int64_t D, KV* dst) {
  constexpr float qmax = is_q8<KV> ? 127.0f : 448.0f;
  float amax = 0.0f;
  for (int64_t j = 0; j < D; ++j) amax = std::max(amax, std::fabs(act_load(x, j)));
  const float scale = amax / qmax, div = std::max(scale, FLT_MIN);
  for (int64_t j = 0; j < D; ++j) {
    const float q = std::clamp(act_load(x, j) / div, -qmax, qmax);
    if constexpr (is_q8<KV>) dst[j] = static_cast<int8_t>(std::nearbyint(q));
    else dst[j] = e4m3{float_to_e4m3(q)};
  }
  std::memcpy(dst + D, &scale, sizeof(float));
}

// In place on qkv [T, (H + 2 KVH) * D] (float32 or bfloat16): rotate-half RoPE on the q and k
// heads (in fp32, stored back in qkv's dtype); then k and v of every token, as qkv now holds
// them, are written to their cache slot (float32, bfloat16, or int8 / fp8 rows with their scale).
template <typename AT, typename KV>
void rope_write_kv_impl(AT* qp, const float* cp, const float* sp, const int64_t* pp,
                        const int64_t* slp, KV* kc, KV* vc, int64_t T, int64_t num_heads,
                        int64_t num_kv_heads, int64_t D) {
  const int64_t half = D / 2, row = (num_heads + 2 * num_kv_heads) * D, kv_row = num_kv_heads * D;
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      AT* r = qp + t * row;
      const float* c = cp + pp[t] * half;
      const float* s = sp + pp[t] * half;
      for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) {
        AT* x = r + h * D;
#pragma omp simd
        for (int64_t j = 0; j < half; ++j) {
          const float x1 = act_load(x, j), x2 = act_load(x, j + half);
          act_store(x, j, x1 * c[j] - x2 * s[j]);
          act_store(x, j + half, x2 * c[j] + x1 * s[j]);
        }
      }
      const AT* k = r + num_heads * D;
      const AT* v = k + kv_row;
      const int64_t rs = row_stride<KV>(D);
      KV* kd = kc + slp[t] * num_kv_heads * rs;
      KV* vd = vc + slp[t] * num_kv_heads * rs;
      if constexpr (scaled_rows<KV>) {
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          quantize_kv_row(k + h * D, D, kd + h * rs);
          quantize_kv_row(v + h * D, D, vd + h * rs);
        }
      } else if constexpr (std::is_same_v<AT, KV>) {
        std::memcpy(kd, k, kv_row * sizeof(KV));
        std::memcpy(vd, v, kv_row * sizeof(KV));
      } else {
#pragma omp simd
        for (int64_t j = 0; j < kv_row; ++j) {
          act_store(kd, j, act_load(k, j));
          act_store(vd, j, act_load(v, j));
        }
      }
    }
  });
}

void rope_write_kv(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
                   const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache,
                   const at::Tensor& slot_mapping, int64_t num_heads, int64_t num_kv_heads,
                   int64_t head_dim) {
  TORCH_CHECK(qkv.is_contiguous(), "rope_write_kv: qkv");
  check_act(qkv, "rope_write_kv: qkv");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "rope_write_kv: cache layout");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() &&
              (is_bf16(k_cache) || k_cache.scalar_type() == at::kFloat || is_scaled_cache(k_cache)),
              "rope_write_kv: cache dtype");
  TORCH_CHECK(!is_scaled_cache(k_cache) || k_cache.size(-1) == head_dim + kScaleBytes,
              "rope_write_kv: an int8 or fp8 cache's rows are head_dim + 4 wide (values, then "
              "the scale)");
  at::Tensor pos = positions.to(at::kLong).contiguous();
  at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t* slp = slots.data_ptr<int64_t>();
  auto run = [&](auto* qp, auto* kc, auto* vc) {
    rope_write_kv_impl(qp, cp, sp, pp, slp, kc, vc, qkv.size(0), num_heads, num_kv_heads,
                       head_dim);
  };
  auto with_cache = [&](auto* qp) {
    if (is_bf16(k_cache)) run(qp, act_ptr<uint16_t>(k_cache), act_ptr<uint16_t>(v_cache));
    else if (k_cache.scalar_type() == at::kChar) run(qp, act_ptr<int8_t>(k_cache), act_ptr<int8_t>(v_cache));
    else if (is_fp8_cache(k_cache)) run(qp, act_ptr<e4m3>(k_cache), act_ptr<e4m3>(v_cache));
    else run(qp, act_ptr<float>(k_cache), act_ptr<float>(v_cache));
  };
  if (is_bf16(qkv)) with_cache(act_ptr<uint16_t>(qkv));
  else with_cache(act_ptr<float>(qkv));
}

// Qwen3's q/k norms, then rope_write_kv: each q and k head of qkv is RMS-normalised over its
// head_dim and scaled by q_norm / k_norm (float32 [head_dim]) in place, in fp32.
template <typename AT>
void qk_norm_impl(AT* qp, int64_t T, int64_t num_heads, int64_t num_kv_heads, int64_t D,
                  const float* qw, const float* kw, float eps) {
  const int64_t row = (num_heads + 2 * num_kv_heads) * D;
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) {
        AT* x = qp + t * row + h * D;
        const float* w = h < num_heads ? qw : kw;
        float ss = 0;
#pragma omp simd reduction(+ : ss)
        for (int64_t j = 0; j < D; ++j) ss += act_load(x, j) * act_load(x, j);
        const float inv = 1.0f / std::sqrt(ss / D + eps);
#pragma omp simd
        for (int64_t j = 0; j < D; ++j) act_store(x, j, w[j] * (act_load(x, j) * inv));
      }
    }
  });
}

void qk_norm_rope_write_kv(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
                           const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache,
                           const at::Tensor& slot_mapping, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, const at::Tensor& q_norm,
                           const at::Tensor& k_norm, double eps) {
  TORCH_CHECK(qkv.is_contiguous(), "qk_norm_rope_write_kv: qkv");
  check_act(qkv, "qk_norm_rope_write_kv: qkv");
  TORCH_CHECK(q_norm.scalar_type() == at::kFloat && k_norm.scalar_type() == at::kFloat &&
                  q_norm.numel() == head_dim && k_norm.numel() == head_dim &&
                  q_norm.is_contiguous() && k_norm.is_contiguous(),
              "qk_norm_rope_write_kv: q_norm and k_norm must be float32 [head_dim]");
  TORCH_CHECK(qkv.size(-1) == (num_heads + 2 * num_kv_heads) * head_dim,
              "qk_norm_rope_write_kv: qkv width is not (H + 2 KVH) * head_dim");
  const float* qw = q_norm.data_ptr<float>();
  const float* kw = k_norm.data_ptr<float>();
  if (is_bf16(qkv))
    qk_norm_impl(act_ptr<uint16_t>(qkv), qkv.size(0), num_heads, num_kv_heads, head_dim, qw, kw, eps);
  else
    qk_norm_impl(act_ptr<float>(qkv), qkv.size(0), num_heads, num_kv_heads, head_dim, qw, kw, eps);
  rope_write_kv(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads,
                head_dim);
}

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

// One work item: query heads [g*G, (g+1)*G) of request b over context tokens [t0, t1).
// Writes per head: part[h] = (max score, sum of exp, unnormalized output[D]).
template <typename KV>
void attend_generic(const float* qg, const KV* kc, const KV* vc, const int64_t* off, int64_t t0,
                    int64_t t1, int64_t G, int64_t KVH, int64_t g, int64_t D,
                    float scale, const int64_t* lim, float* part, float* scores) {
  const int64_t n = t1 - t0, pstride = D + 2, rs = row_stride<KV>(D);
  for (int64_t t = t0; t < t1; ++t) {
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
    for (int64_t j = 0; j < D; ++j) part[h * pstride + 2 + j] = 0;
  for (int64_t t = t0; t < t1; ++t) {
    const KV* v = vc + off[t - t0] + g * rs;
    const float vs = row_scale(v, D);
    for (int64_t h = 0; h < G; ++h) {
      const float p = scores[h * n + (t - t0)] * vs;
      float* o = part + h * pstride + 2;
#pragma omp simd
      for (int64_t j = 0; j < D; ++j) o[j] += p * load_kv(v, j);
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
  int64_t t = t0;
  for (; t + 8 <= t1; t += 8) {
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
  for (int64_t g = 0; g < KVH; ++g) {
    softmax_scores(scores + g * R * n, n, R, lim, parts[g], pstride);
    for (int64_t h = 0; h < R; ++h)
      for (int64_t j = 0; j < D; ++j) parts[g][h * pstride + 2 + j] = 0.0f;
  }
  constexpr int VB = DV <= 4 ? 6 : 3;  // VB * DV output registers + DV value registers fit in 32
  constexpr int64_t kChunk = 64;  // 64 tokens of V, all heads: 48 KB (fp32)
  for (int64_t c0 = t0; c0 < t1; c0 += kChunk) {
    const int64_t c1 = std::min(t1, c0 + kChunk);
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

// One work item over a single wide KV head (MLA's latent row: every query head attends to the
// same row, D = 16 * dv of any width, e.g. 320 or 576): R query rows against tokens [t0, t1).
// Scores: for 8 tokens x HB rows the d-chunks run innermost with the 8 x HB dot products in
// registers (the row's chunks stream from L1; no register file holds a 576-wide row), reduced
// together by hsum8. Outputs: 64 values of D at a time for up to VB rows, over every token.
template <typename KV>
void attend_wide_avx512(const float* qg, const KV* kc, const KV* vc, const int64_t* off,
                        int64_t t0, int64_t t1, int64_t R, int64_t D, float scale,
                        const int64_t* lim, float* part, float* scores) {
  constexpr int HB = 3;  // 3 * 8 accumulators + 3 query + 1 key registers fit in 32
  const int64_t n = t1 - t0, pstride = D + 2, dv = D / 16;
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
  softmax_scores(scores, n, R, lim, part, pstride);
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
                           int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t block_size,
                           int64_t max_blocks, float scale, int64_t split, int64_t num_splits,
                           int64_t max_q, float* partial, float* out, int64_t threads) {
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
    if ((D == 64 || D == 128) && t0 < t1) {
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
      if (D == 64)
        attend_heads_avx512<KV, 4>(qgs.data(), kc, vc, offs.data(), t0, t1, R, KVH, scale, lim.data(),
                                   parts.data(), scores.data());
      else
        attend_heads_avx512<KV, 8>(qgs.data(), kc, vc, offs.data(), t0, t1, R, KVH, scale, lim.data(),
                                   parts.data(), scores.data());
      return;
    }
    if constexpr (!scaled_rows<KV>) {  // (MLA refuses the int8 and fp8 formats)
      if (KVH == 1 && D % 16 == 0 && t0 < t1) {  // MLA's latent row (absorbed decode)
        const float* qg = q + qstart[b] * H * D;  // rows j * G + h: already in that order
        scores.resize(R * (t1 - t0));
        attend_wide_avx512<KV>(qg, kc, vc, offs.data(), t0, t1, R, D, scale, lim.data(),
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
      attend_generic<KV>(qg, kc, vc, offs.data(), t0, t1, R, KVH, g, D, scale,
                 lim.data(), part, scores.data());
    }
  };
  auto merge_fn = [&](int64_t b) {
    for (int64_t j = 0; j < qlen[b]; ++j)
      for (int64_t h = 0; h < H; ++h)
        merge_splits(part_at(b, h / G, 0) + (j * G + h % G) * pstride, num_splits, RG * pstride, D,
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
at::Tensor decode_attention(const at::Tensor& q_in, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables_in,
                            const at::Tensor& context_lens_in, double scale, int64_t split,
                            int64_t threads, const std::optional<at::Tensor>& query_lens_in) {
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
  const int64_t num_splits = (max_ctx + split - 1) / split;
  at::Tensor partial = at::empty({B * KVH * num_splits * max_q * (H / KVH) * (D + 2)}, q.options());
  at::Tensor out = at::empty_like(q);
  const int64_t max_blocks = tables.size(1);
  auto run = [&](auto* kc, auto* vc) {
    decode_attention_impl(q.data_ptr<float>(), kc, vc, tables.data_ptr<int32_t>(), cp, qp,
                          qstart.data(), B, H, KVH, D, block_size, max_blocks,
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
        qstart.data(), B, H, KVH, D, block_size, max_blocks, static_cast<float>(scale), split,
        num_splits, max_q, partial.data_ptr<float>(), out.data_ptr<float>(), threads);
  } else {
    TORCH_CHECK(k_cache.scalar_type() == at::kFloat,
                "decode_attention: cache float32, bfloat16, int8 or float8_e4m3fn");
    decode_attention_impl<float>(q.data_ptr<float>(), k_cache.data_ptr<float>(),
                                 v_cache.data_ptr<float>(), tables.data_ptr<int32_t>(), cp, qp,
                                 qstart.data(), B, H, KVH, D, block_size, max_blocks,
                                 static_cast<float>(scale), split, num_splits, max_q,
                                 partial.data_ptr<float>(), out.data_ptr<float>(), threads);
  }
  return out;
}

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
  const float qscale = scale * kLog2e;
  for (int64_t r = 0; r < kRows; ++r) {
    const bool real = r < rows;
    const float* qr = real ? q + ((first + r / G) * s.H + g * G + r % G) * D : nullptr;
    for (int64_t d = 0; d < D; ++d) qt[d * kRows + r] = real ? qr[d] * qscale : 0.0f;
    qpos[r] = real ? static_cast<int32_t>(pos0 + r / G) : INT32_MAX;  // padding sees every key
    m[r] = -INFINITY;
    l[r] = 0.0f;
  }
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
    // Causal mask (only tiles that reach past the tile's first query), row max, P, row sum.
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
    alignas(64) float al[kRows];
    for (int v = 0; v < RV; ++v) {
      _mm512_store_ps(l + 16 * v, sum[v]);
      _mm512_store_ps(al + 16 * v, alpha[v]);
    }
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
#endif

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
    const int64_t tile = tiles - 1 - item / s.KVH, g = item % s.KVH;
#if defined(__AVX512F__)
    if (s.D == 64) return prefill_item_avx512<KV, 4>(q, kc, vc, table, s, g, tile, scale, out);
    if (s.D == 128) return prefill_item_avx512<KV, 8>(q, kc, vc, table, s, g, tile, scale, out);
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

template <typename KV>
void amx_pack_kv(const KV* kc, const KV* vc, const int32_t* table, int64_t block_size,
                 int64_t KVH, int64_t g, int64_t ctx, int64_t nkb32, uint16_t* kp, uint16_t* vt) {
  // Keys past ctx stay zero (masked by the causal limit; zero so 0 * V stays 0).
  std::memset(kp, 0, nkb32 * 32 * kAmxD * sizeof(uint16_t));
  std::memset(vt, 0, nkb32 * 32 * kAmxD * sizeof(uint16_t));
  for_each_slot(table, block_size, 0, ctx, [&](int64_t t, int64_t slot) {
    const KV* k = kc + (slot * KVH + g) * kAmxD;
    const KV* v = vc + (slot * KVH + g) * kAmxD;
    uint16_t* kr = kp + t * kAmxD;
    for (int64_t d = 0; d < kAmxD; ++d) kr[d] = float_to_bf16(load_kv(k, d));
    uint16_t* vr = vt + (t / 32) * (32 * kAmxD) + (t % 32);
    for (int64_t d = 0; d < kAmxD; ++d) vr[(d / 16) * 512 + (d % 16) * 32] = float_to_bf16(load_kv(v, d));
  });
}

// 2^x for x <= 0 feeding bf16 probabilities: degree-5 polynomial on [-0.5, 0.5] (relative
// error ~2.4e-6, far below bf16's 2^-9); very negative x underflows to 0 through scalef.
inline __m512 exp2_short_ps(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.3333558146428443e-3f);  // ln2^5 / 5!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));  // ln2^4 / 4!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));  // ln2^3 / 3!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24022650695910071f));    // ln2^2 / 2
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.69314718055994531f));    // ln2
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
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
    for (int j = 0; j < 32; ++j) {
      const int64_t t = b * 32 + j - first_pos;
      vis[j] = !diagonal || t <= 0 ? 0xffff : t >= 16 ? 0 : static_cast<__mmask16>(0xffffu << t);
    }
    __m512 raw_max = _mm512_set1_ps(-INFINITY);
    for (int j = 0; j < 32; ++j)
      raw_max = _mm512_mask_max_ps(raw_max, vis[j], raw_max, _mm512_load_ps(st + j * 16));
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
  std::vector<uint16_t> kbuf(KVH * per_head), vbuf(KVH * per_head);
  parallel_tasks(KVH, [&](int64_t g) {
    if (bf16)
      amx_pack_kv(reinterpret_cast<const uint16_t*>(k_cache.data_ptr()),
                  reinterpret_cast<const uint16_t*>(v_cache.data_ptr()), tp, bs, KVH, g, ctx_len,
                  nkb32, kbuf.data() + g * per_head, vbuf.data() + g * per_head);
    else
      amx_pack_kv(k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), tp, bs, KVH, g, ctx_len,
                  nkb32, kbuf.data() + g * per_head, vbuf.data() + g * per_head);
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
    amx_attend_block(qp + h * kAmxD, q_stride, T, off, qb * 16, kbuf.data() + g * per_head,
                     vbuf.data() + g * per_head, sc, op + h * kAmxD, H * kAmxD);
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

// ---------------------------------------------------------------------------------------------
// One whole Llama decoder layer for a step of decodes only (one token per request), so a decode
// step pays one Python call per layer instead of a dozen. The same ops as the module path, in
// the same order; `residual` is updated in place (and is `x` itself for the first layer).
//   w: [qkv.qs, qkv.d, qkv.m, o.qs, o.d, o.m, gate_up.qs, gate_up.d, gate_up.m,
//       down.qs, down.d, down.m];  types: their ggml types
std::tuple<at::Tensor, at::Tensor> decode_layer(
    const at::Tensor& x, const at::Tensor& residual_in, bool has_residual,
    const at::Tensor& in_norm, const at::Tensor& post_norm, double eps, at::TensorList w,
    at::IntArrayRef types, const at::Tensor& cos, const at::Tensor& sin,
    const at::Tensor& positions, at::Tensor k_cache, at::Tensor v_cache,
    const at::Tensor& slot_mapping, const at::Tensor& block_tables,
    const at::Tensor& context_lens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t intermediate, double scale, int64_t split, int64_t threads, bool int8_act,
    const std::optional<at::Tensor>& query_lens) {
  TORCH_CHECK(w.size() == 12 && types.size() == 4, "decode_layer: 4 packed weights");
  const int64_t T = x.size(0), hidden = x.size(1);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  at::Tensor residual = has_residual ? residual_in : x;
  at::Tensor normed = has_residual ? add_rms_norm(x, residual, in_norm, eps) : rms_norm(x, in_norm, eps);
  at::Tensor qkv = qlinear(normed, w[0], w[1], w[2], types[0], q_size + 2 * kv_size, hidden, threads, int8_act);
  rope_write_kv(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads,
                head_dim);
  at::Tensor q = qkv.narrow(1, 0, q_size).reshape({T, num_heads, head_dim});
  at::Tensor attn = decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, split, threads,
                                     query_lens);
  at::Tensor h = qlinear(attn.view({T, q_size}), w[3], w[4], w[5], types[1], hidden, q_size, threads, int8_act);
  at::Tensor normed2 = add_rms_norm(h, residual, post_norm, eps);
  at::Tensor gate_up = qlinear(normed2, w[6], w[7], w[8], types[2], 2 * intermediate, hidden, threads, int8_act);
  at::Tensor act = silu_mul(gate_up);
  at::Tensor out = qlinear(act, w[9], w[10], w[11], types[3], hidden, intermediate, threads, int8_act);
  return {out, residual};
}

// Layers [0, L) of the model for a step of short queries only, one decode_layer after another
// in one call: a batch-1 decode step made 30 Python calls of 25 arguments each (~1 ms of an
// 11 ms step on this machine); now it makes one. Per layer l: norms[2l], norms[2l + 1] (input,
// post-attention), w[12l .. 12l + 11] and types[4l .. 4l + 3] as decode_layer takes them, and
// k_caches[l], v_caches[l]. Returns (hidden, residual) after the last layer.
std::tuple<at::Tensor, at::Tensor> decode_layers(
    const at::Tensor& x, const at::Tensor& residual_in, bool has_residual, at::TensorList norms,
    double eps, at::TensorList w, at::IntArrayRef types, const at::Tensor& cos,
    const at::Tensor& sin, const at::Tensor& positions, at::TensorList k_caches,
    at::TensorList v_caches, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
    const at::Tensor& context_lens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t intermediate, double scale, int64_t split, int64_t threads, bool int8_act,
    const std::optional<at::Tensor>& query_lens) {
  const int64_t L = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(L >= 1 && static_cast<int64_t>(v_caches.size()) == L &&
                  static_cast<int64_t>(norms.size()) == 2 * L &&
                  static_cast<int64_t>(w.size()) == 12 * L &&
                  static_cast<int64_t>(types.size()) == 4 * L,
              "decode_layers: per layer 2 norms, 12 weight tensors, 4 types and a K and V cache");
  at::Tensor hidden = x, residual = residual_in;
  bool has = has_residual;
  for (int64_t l = 0; l < L; ++l) {
    std::tie(hidden, residual) = decode_layer(
        hidden, residual, has, norms[2 * l], norms[2 * l + 1], eps, w.slice(12 * l, 12),
        types.slice(4 * l, 4), cos, sin, positions, k_caches[l], v_caches[l], slot_mapping,
        block_tables, context_lens, num_heads, num_kv_heads, head_dim, intermediate, scale, split,
        threads, int8_act, query_lens);
    has = true;
  }
  return {hidden, residual};
}

// ggml blocks -> the layout qlinear reads (hearth.ops.cpu_kernels.pack_ggml): each block's fp16
// scale (and Q4_1 offset) moved to its own array, its quants kept in row order. The output rows
// interleave the parts by group: for each of `groups` groups, rows_per_group[p] rows of each
// part p in turn (one group: QKV stacked; groups = experts: each expert's [gate | up]).
// A plain copy, but torch's strided copy of 32-byte runs took ~2 s for a 1 GB MoE model.
std::vector<at::Tensor> repack_ggml(const std::vector<at::Tensor>& parts,
                                    const std::vector<int64_t>& rows_per_group, int64_t groups,
                                    int64_t qtype, int64_t threads) {
  TORCH_CHECK(qtype == kQ4_0 || qtype == kQ4_1 || qtype == kQ8_0, "repack_ggml: ggml type ", qtype);
  TORCH_CHECK(!parts.empty() && parts.size() == rows_per_group.size() && groups >= 1,
              "repack_ggml: one rows_per_group entry per part");
  const int64_t bbytes = qtype == kQ8_0 ? 34 : qtype == kQ4_1 ? 20 : 18;
  const int64_t head = qtype == kQ4_1 ? 4 : 2, qbytes = bbytes - head;
  const int64_t row_bytes = parts[0].size(-1), nb = row_bytes / bbytes;
  int64_t group_rows = 0;
  for (size_t p = 0; p < parts.size(); ++p) {
    TORCH_CHECK(parts[p].scalar_type() == at::kByte && parts[p].is_contiguous() &&
                    parts[p].dim() == 2 && parts[p].size(1) == row_bytes &&
                    parts[p].size(0) == groups * rows_per_group[p],
                "repack_ggml: part ", p, " must be uint8 [groups * rows, row bytes]");
    group_rows += rows_per_group[p];
  }
  TORCH_CHECK(row_bytes % bbytes == 0, "repack_ggml: row bytes are not whole blocks");
  const int64_t N = groups * group_rows;
  auto u8 = parts[0].options();
  at::Tensor qs = at::empty({N, nb * qbytes}, u8);
  at::Tensor d = at::empty({N, nb}, u8.dtype(at::kHalf));
  at::Tensor m = qtype == kQ4_1 ? at::empty({N, nb}, u8.dtype(at::kHalf)) : at::empty({0}, u8.dtype(at::kHalf));
  uint8_t* qp = qs.data_ptr<uint8_t>();
  uint16_t* dp = reinterpret_cast<uint16_t*>(d.data_ptr());
  uint16_t* mp = qtype == kQ4_1 ? reinterpret_cast<uint16_t*>(m.data_ptr()) : nullptr;
  parallel_tasks(groups * parts.size(), [&](int64_t task) {
    const int64_t g = task / parts.size(), p = task % parts.size(), rows = rows_per_group[p];
    int64_t out_row = g * group_rows;
    for (size_t q = 0; q < static_cast<size_t>(p); ++q) out_row += rows_per_group[q];
    const uint8_t* src = parts[p].data_ptr<uint8_t>() + g * rows * row_bytes;
    for (int64_t r = 0; r < rows; ++r) {
      const uint8_t* row = src + r * row_bytes;
      const int64_t o = out_row + r;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = row + b * bbytes;
        std::memcpy(dp + o * nb + b, blk, 2);
        if (mp) std::memcpy(mp + o * nb + b, blk + 2, 2);
        std::memcpy(qp + (o * nb + b) * qbytes, blk + head, qbytes);
      }
    }
  }, threads);
  return {qs, d, m};
}

// Which instruction set this build was compiled for (the loader checks it against its choice).
int64_t isa() {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  return 514;
#elif defined(__AVX512VNNI__)
  return 513;
#elif defined(__AVX512F__)
  return 512;
#else
  return 256;
#endif
}

#include "moe.h"  // moe_experts (Mixture-of-Experts layers), on qlinear's tiles

}  // namespace
}  // namespace hearth

TORCH_LIBRARY(hearth, m) {
  m.def("qlinear(Tensor x, Tensor qs, Tensor d, Tensor m, int qtype, int out_features, "
        "int in_features, int threads=64, bool int8_act=False) -> Tensor",
        &hearth::qlinear);
  m.def("rms_norm(Tensor x, Tensor weight, float eps, bool bf16_out=False) -> Tensor", &hearth::rms_norm);
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps, bool bf16_out=False) -> Tensor",
        &hearth::add_rms_norm);
  m.def("silu_mul(Tensor gate_up) -> Tensor", &hearth::silu_mul);
  m.def("rope_write_kv(Tensor(a!) qkv, Tensor positions, Tensor cos, Tensor sin, Tensor(b!) k_cache, "
        "Tensor(c!) v_cache, Tensor slot_mapping, int num_heads, int num_kv_heads, int head_dim) -> ()",
        &hearth::rope_write_kv);
  m.def("qk_norm_rope_write_kv(Tensor(a!) qkv, Tensor positions, Tensor cos, Tensor sin, "
        "Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor slot_mapping, int num_heads, "
        "int num_kv_heads, int head_dim, Tensor q_norm, Tensor k_norm, float eps) -> ()",
        &hearth::qk_norm_rope_write_kv);
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, float scale, int split, int threads=64, Tensor? query_lens=None) "
        "-> Tensor",
        &hearth::decode_attention);
  m.def("prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
        "int context_len, float scale, int threads=64) -> Tensor",
        &hearth::prefill_attention);
  m.def("decode_layer(Tensor x, Tensor(a!) residual, bool has_residual, Tensor in_norm, "
        "Tensor post_norm, float eps, Tensor[] w, int[] types, Tensor cos, Tensor sin, "
        "Tensor positions, Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor slot_mapping, "
        "Tensor block_tables, Tensor context_lens, int num_heads, int num_kv_heads, "
        "int head_dim, int intermediate, float scale, int split, int threads=64, bool int8_act=False, "
        "Tensor? query_lens=None) "
        "-> (Tensor, Tensor)",
        &hearth::decode_layer);
  m.def("decode_layers(Tensor x, Tensor(a!) residual, bool has_residual, Tensor[] norms, "
        "float eps, Tensor[] w, int[] types, Tensor cos, Tensor sin, Tensor positions, "
        "Tensor(b!)[] k_caches, Tensor(c!)[] v_caches, Tensor slot_mapping, Tensor block_tables, "
        "Tensor context_lens, int num_heads, int num_kv_heads, int head_dim, int intermediate, "
        "float scale, int split, int threads=64, bool int8_act=False, Tensor? query_lens=None) "
        "-> (Tensor, Tensor)",
        &hearth::decode_layers);
  m.def("moe_experts(Tensor x, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids, "
        "int expert_start, Tensor[] q, int[] qtypes, int threads=64, bool int8_act=False) -> Tensor",
        &hearth::moe_experts);
  m.def("moe_topk(Tensor logits, int k, bool renormalize, Tensor(a!) counts) -> (Tensor, Tensor)",
        &hearth::moe_topk);
  m.def("repack_ggml(Tensor[] parts, int[] rows_per_group, int groups, int qtype, int threads=64) "
        "-> Tensor[]", &hearth::repack_ggml);
  m.def("isa() -> int", &hearth::isa);
  m.def("amx_attention_usable() -> bool", &hearth::amx_attention_usable);
  m.def("amx_prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
        "int ctx_len, float scale, int threads) -> Tensor", &hearth::amx_prefill_attention);
}
