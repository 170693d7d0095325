// hearth's CPU kernels: the ops a decode step spends its time in, fused so a step makes one pass
// over memory per op instead of one per torch call.
//
//   qlinear          y = x W^T with W kept in ggml block formats (Q8_0, Q4_0, Q4_1): weights are
//                    dequantized in registers, activations stay float32. A batch-1 step is bound
//                    by reading weights, so 4.5-8.5 bits per weight instead of 32 is the speed-up.
//   decode_attention one query token per request over the paged cache, read in place through the
//                    block table (no gather), split along the context for parallelism, cache in
//                    float32 or bfloat16.
//   rms_norm, add_rms_norm, silu_mul, rope_write_kv: elementwise passes, fused.
//
// The same source is compiled twice by hearth/ops/build_kernels.py: once for AVX-512
// (-mavx512f/bw/vl/dq) and once for AVX2; the loader picks the build this CPU runs (probed in a
// subprocess, so a CPU that lists a feature it cannot execute falls back instead of dying).
// Only the weight loop has hand-written AVX-512; everything else is plain loops the compiler
// vectorizes (`#pragma omp simd`) for either target.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace hearth {
namespace {

constexpr int64_t kQK = 32;  // elements per ggml block
// ggml type ids
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;

int64_t block_bytes(int64_t qtype) {
  switch (qtype) {
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ8_0: return 34;
  }
  TORCH_CHECK(false, "qlinear: unsupported ggml type ", qtype);
}

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

inline float bf16_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even (as torch's .to(bfloat16))
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
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

// ---------------------------------------------------------------------------------------------
// qlinear: out[m, n] = sum_k x[m, k] * W[n, k]; W row n is K/32 ggml blocks.
// A tile of NR weight rows x MT activation rows keeps NR * MT * 2 accumulators in registers, so
// each dequantized block is used MT times and the FMA chains are independent.

#if defined(__AVX512F__)
inline void dequant_block(int64_t qtype, const uint8_t* blk, __m512& lo, __m512& hi) {
  if (qtype == kQ8_0) {
    const __m512 d = _mm512_set1_ps(half_to_float(blk));
    const __m128i* q = reinterpret_cast<const __m128i*>(blk + 2);
    lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q))), d);
    hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1))), d);
    return;
  }
  const bool has_min = qtype == kQ4_1;
  const __m512 d = _mm512_set1_ps(half_to_float(blk));
  const __m512 m = has_min ? _mm512_set1_ps(half_to_float(blk + 2)) : _mm512_set1_ps(-8.0f * half_to_float(blk));
  const __m512i bytes = _mm512_cvtepu8_epi32(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (has_min ? 4 : 2))));
  const __m512i mask = _mm512_set1_epi32(0xF);
  lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(bytes, mask)), d, m);
  hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4)), d, m);
}

template <int NR, int MT>
void qlinear_tile(int64_t qtype, const uint8_t* w, int64_t row_bytes, int64_t nb, const float* x,
                  int64_t ldx, float* out, int64_t ldo, int64_t bbytes) {
  __m512 acc[NR][MT][2];
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < MT; ++i) acc[r][i][0] = acc[r][i][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512 xl[MT], xh[MT];
    for (int i = 0; i < MT; ++i) {
      xl[i] = _mm512_loadu_ps(x + i * ldx + b * kQK);
      xh[i] = _mm512_loadu_ps(x + i * ldx + b * kQK + 16);
    }
    for (int r = 0; r < NR; ++r) {
      __m512 lo, hi;
      dequant_block(qtype, w + r * row_bytes + b * bbytes, lo, hi);
      for (int i = 0; i < MT; ++i) {
        acc[r][i][0] = _mm512_fmadd_ps(lo, xl[i], acc[r][i][0]);
        acc[r][i][1] = _mm512_fmadd_ps(hi, xh[i], acc[r][i][1]);
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < MT; ++i)
      out[i * ldo + r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][i][0], acc[r][i][1]));
}
#else
inline void dequant_block(int64_t qtype, const uint8_t* blk, float* wf) {
  const float d = half_to_float(blk);
  if (qtype == kQ8_0) {
    const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
#pragma omp simd
    for (int j = 0; j < 32; ++j) wf[j] = static_cast<float>(q[j]) * d;
    return;
  }
  const bool has_min = qtype == kQ4_1;
  const float m = has_min ? half_to_float(blk + 2) : -8.0f * d;
  const uint8_t* q = blk + (has_min ? 4 : 2);
#pragma omp simd
  for (int j = 0; j < 16; ++j) {
    wf[j] = static_cast<float>(q[j] & 0xF) * d + m;
    wf[j + 16] = static_cast<float>(q[j] >> 4) * d + m;
  }
}

template <int NR, int MT>
void qlinear_tile(int64_t qtype, const uint8_t* w, int64_t row_bytes, int64_t nb, const float* x,
                  int64_t ldx, float* out, int64_t ldo, int64_t bbytes) {
  float acc[NR][MT][8] = {};
  alignas(64) float wf[32];
  for (int64_t b = 0; b < nb; ++b) {
    for (int r = 0; r < NR; ++r) {
      dequant_block(qtype, w + r * row_bytes + b * bbytes, wf);
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

template <int NR>
void qlinear_rows(int64_t qtype, const uint8_t* w, int64_t row_bytes, int64_t nb, const float* x,
                  int64_t M, int64_t K, float* out, int64_t N, int64_t bbytes) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4)
    qlinear_tile<NR, 4>(qtype, w, row_bytes, nb, x + m * K, K, out + m * N, N, bbytes);
  for (; m < M; ++m)
    qlinear_tile<NR, 1>(qtype, w, row_bytes, nb, x + m * K, K, out + m * N, N, bbytes);
}

at::Tensor qlinear(const at::Tensor& x_in, const at::Tensor& qweight, int64_t qtype,
                   int64_t out_features, int64_t in_features) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat, "qlinear: activations must be float32");
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.dim() == 2, "qlinear: qweight uint8 [N, bytes]");
  TORCH_CHECK(in_features % kQK == 0, "qlinear: in_features must be a multiple of 32");
  const int64_t bbytes = block_bytes(qtype);
  const int64_t nb = in_features / kQK;
  TORCH_CHECK(qweight.size(0) == out_features && qweight.size(1) == nb * bbytes,
              "qlinear: qweight shape does not match the ggml layout");
  TORCH_CHECK(x_in.size(-1) == in_features, "qlinear: last dim of x must be in_features");
  at::Tensor x = x_in.reshape({-1, in_features}).contiguous();
  at::Tensor w = qweight.contiguous();
  const int64_t M = x.size(0), N = out_features, row_bytes = nb * bbytes;
  auto out_shape = x_in.sizes().vec();
  out_shape.back() = N;
  at::Tensor out = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  constexpr int64_t NR = 4;
  const int64_t num_groups = N / NR;
  // Each task takes whole groups of NR rows; the grain keeps tasks large enough to amortize.
  at::parallel_for(0, num_groups, 8, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      qlinear_rows<NR>(qtype, wp + g * NR * row_bytes, row_bytes, nb, xp, M, in_features,
                       op + g * NR, N, bbytes);
  });
  for (int64_t n = num_groups * NR; n < N; ++n)
    qlinear_rows<1>(qtype, wp + n * row_bytes, row_bytes, nb, xp, M, in_features, op + n, N, bbytes);
  return out.view(out_shape);
}

// Dequantize a whole ggml matrix to float32 (the prefill path multiplies with MKL).
at::Tensor dequantize_rows(const at::Tensor& qweight, int64_t qtype, int64_t out_features,
                           int64_t in_features) {
  const int64_t bbytes = block_bytes(qtype), nb = in_features / kQK;
  at::Tensor w = qweight.contiguous();
  at::Tensor out = at::empty({out_features, in_features}, at::kFloat);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, out_features, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = wp + n * nb * bbytes + b * bbytes;
        float* dst = op + n * in_features + b * kQK;
#if defined(__AVX512F__)
        __m512 lo, hi;
        dequant_block(qtype, blk, lo, hi);
        _mm512_storeu_ps(dst, lo);
        _mm512_storeu_ps(dst + 16, hi);
#else
        dequant_block(qtype, blk, dst);
#endif
      }
  });
  return out;
}

// ---------------------------------------------------------------------------------------------
// Elementwise fusions.

void rms_row(const float* x, const float* w, float eps, int64_t D, float* out) {
  float ss = 0;
#pragma omp simd reduction(+ : ss)
  for (int64_t j = 0; j < D; ++j) ss += x[j] * x[j];
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(D) + eps);
#pragma omp simd
  for (int64_t j = 0; j < D; ++j) out[j] = w[j] * (x[j] * r);
}

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "rms_norm: float32");
  const int64_t D = x_in.size(-1);
  at::Tensor x = x_in.reshape({-1, D}).contiguous();
  at::Tensor out = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, x.size(0), 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) rms_row(xp + t * D, wp, static_cast<float>(eps), D, op + t * D);
  });
  return out.view(x_in.sizes());
}

// residual += x (in place); returns rms_norm(residual) * weight.
at::Tensor add_rms_norm(const at::Tensor& x_in, at::Tensor& residual, const at::Tensor& weight,
                        double eps) {
  TORCH_CHECK(residual.is_contiguous() && residual.scalar_type() == at::kFloat, "add_rms_norm: residual");
  const int64_t D = residual.size(-1);
  at::Tensor x = x_in.reshape({-1, D}).contiguous();
  at::Tensor out = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, x.size(0), 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* r = rp + t * D;
      const float* xr = xp + t * D;
#pragma omp simd
      for (int64_t j = 0; j < D; ++j) r[j] = r[j] + xr[j];
      rms_row(r, wp, static_cast<float>(eps), D, op + t * D);
    }
  });
  return out.view(residual.sizes());
}

// [T, 2I] (gate | up) -> [T, I]: silu(gate) * up.
at::Tensor silu_mul(const at::Tensor& gate_up_in) {
  at::Tensor gu = gate_up_in.contiguous();
  TORCH_CHECK(gu.scalar_type() == at::kFloat, "silu_mul: float32");
  const int64_t T = gu.size(0), I = gu.size(1) / 2;
  at::Tensor out = at::empty({T, I}, gu.options());
  const float* gp = gu.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* g = gp + t * 2 * I;
      const float* u = g + I;
      float* o = op + t * I;
#pragma omp simd
      for (int64_t j = 0; j < I; ++j) o[j] = g[j] / (1.0f + fast_exp(-g[j])) * u[j];
    }
  });
  return out;
}

// In place on qkv [T, (H + 2 KVH) * D]: rotate-half RoPE on the q and k heads; then k and v of
// every token are written to their cache slot (float32 or bfloat16 cache).
void rope_write_kv(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
                   const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache,
                   const at::Tensor& slot_mapping, int64_t num_heads, int64_t num_kv_heads,
                   int64_t head_dim) {
  TORCH_CHECK(qkv.is_contiguous() && qkv.scalar_type() == at::kFloat, "rope_write_kv: qkv");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "rope_write_kv: cache layout");
  const bool bf16 = k_cache.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || k_cache.scalar_type() == at::kFloat, "rope_write_kv: cache dtype");
  at::Tensor pos = positions.to(at::kLong).contiguous();
  at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t T = qkv.size(0), D = head_dim, half = D / 2;
  const int64_t row = (num_heads + 2 * num_kv_heads) * D, kv_row = num_kv_heads * D;
  float* qp = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t* slp = slots.data_ptr<int64_t>();
  void* kc = k_cache.data_ptr();
  void* vc = v_cache.data_ptr();
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* r = qp + t * row;
      const float* c = cp + pp[t] * half;
      const float* s = sp + pp[t] * half;
      for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) {
        float* x = r + h * D;
#pragma omp simd
        for (int64_t j = 0; j < half; ++j) {
          const float x1 = x[j], x2 = x[j + half];
          x[j] = x1 * c[j] - x2 * s[j];
          x[j + half] = x2 * c[j] + x1 * s[j];
        }
      }
      const float* k = r + num_heads * D;
      const float* v = k + kv_row;
      const int64_t dst = slp[t] * kv_row;
      if (bf16) {
        uint16_t* kd = static_cast<uint16_t*>(kc) + dst;
        uint16_t* vd = static_cast<uint16_t*>(vc) + dst;
        for (int64_t j = 0; j < kv_row; ++j) {
          kd[j] = float_to_bf16(k[j]);
          vd[j] = float_to_bf16(v[j]);
        }
      } else {
        std::memcpy(static_cast<float*>(kc) + dst, k, kv_row * sizeof(float));
        std::memcpy(static_cast<float*>(vc) + dst, v, kv_row * sizeof(float));
      }
    }
  });
}

// ---------------------------------------------------------------------------------------------
// Decode attention over the paged cache.
//
//   work item = (request b, kv head g, context split s); split s covers tokens [s*S, (s+1)*S)
//   of request b and the G = H / KVH query heads that share kv head g. Each item writes a
//   partial (max, sum, unnormalized out) per query head; a second pass merges the splits.

template <typename KV>
inline float load_kv(const KV* p, int64_t j);
template <>
inline float load_kv<float>(const float* p, int64_t j) { return p[j]; }
template <>
inline float load_kv<uint16_t>(const uint16_t* p, int64_t j) { return bf16_to_float(p[j]); }

template <typename KV>
void decode_attention_impl(const float* q, const KV* kc, const KV* vc, const int32_t* tables,
                           const int32_t* ctx, int64_t B, int64_t H, int64_t KVH, int64_t D,
                           int64_t block_size, int64_t max_blocks, float scale, int64_t split,
                           int64_t num_splits, float* partial, float* out) {
  const int64_t G = H / KVH, pstride = D + 2;
  at::parallel_for(0, B * KVH * num_splits, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores;
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t b = item / (KVH * num_splits), g = (item / num_splits) % KVH, s = item % num_splits;
      const int64_t t0 = s * split, t1 = std::min<int64_t>(ctx[b], t0 + split);
      float* part = partial + ((b * KVH + g) * num_splits + s) * G * pstride;
      if (t0 >= t1) {
        for (int64_t h = 0; h < G; ++h) part[h * pstride] = -INFINITY, part[h * pstride + 1] = 0;
        continue;
      }
      const int64_t n = t1 - t0;
      scores.resize(G * n);
      const float* qg = q + (b * H + g * G) * D;
      const int32_t* table = tables + b * max_blocks;
      for (int64_t t = t0; t < t1; ++t) {
        const KV* k = kc + ((static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size) * KVH + g) * D;
        for (int64_t h = 0; h < G; ++h) {
          const float* qh = qg + h * D;
          float dot = 0;
#pragma omp simd reduction(+ : dot)
          for (int64_t j = 0; j < D; ++j) dot += qh[j] * load_kv(k, j);
          scores[h * n + (t - t0)] = dot * scale;
        }
      }
      for (int64_t h = 0; h < G; ++h) {
        float* sc = scores.data() + h * n;
        float mx = -INFINITY;
        for (int64_t i = 0; i < n; ++i) mx = std::max(mx, sc[i]);
        float sum = 0;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < n; ++i) {
          sc[i] = fast_exp(sc[i] - mx);
          sum += sc[i];
        }
        part[h * pstride] = mx;
        part[h * pstride + 1] = sum;
        float* o = part + h * pstride + 2;
        for (int64_t j = 0; j < D; ++j) o[j] = 0;
      }
      for (int64_t t = t0; t < t1; ++t) {
        const KV* v = vc + ((static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size) * KVH + g) * D;
        for (int64_t h = 0; h < G; ++h) {
          const float p = scores[h * n + (t - t0)];
          float* o = part + h * pstride + 2;
#pragma omp simd
          for (int64_t j = 0; j < D; ++j) o[j] += p * load_kv(v, j);
        }
      }
    }
  });
  at::parallel_for(0, B * H, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / H, h = r % H, g = h / G, hg = h % G;
      const float* base = partial + (b * KVH + g) * num_splits * G * pstride + hg * pstride;
      float mx = -INFINITY;
      for (int64_t s = 0; s < num_splits; ++s) mx = std::max(mx, base[s * G * pstride]);
      float* o = out + r * D;
      for (int64_t j = 0; j < D; ++j) o[j] = 0;
      float denom = 0;
      for (int64_t s = 0; s < num_splits; ++s) {
        const float* p = base + s * G * pstride;
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
  });
}

// q [B, H, D] float32; caches [num_blocks, block_size, KVH, D]; block_tables [B, max_blocks]
// int32; context_lens [B] int32. Returns [B, H, D].
at::Tensor decode_attention(const at::Tensor& q_in, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables_in,
                            const at::Tensor& context_lens_in, double scale, int64_t split) {
  at::Tensor q = q_in.contiguous();
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.dim() == 3, "decode_attention: q float32 [B, H, D]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4,
              "decode_attention: cache [num_blocks, block_size, KVH, D]");
  at::Tensor tables = block_tables_in.to(at::kInt).contiguous();
  at::Tensor ctx = context_lens_in.to(at::kInt).contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t block_size = k_cache.size(1), KVH = k_cache.size(2);
  TORCH_CHECK(H % KVH == 0 && k_cache.size(3) == D, "decode_attention: head shapes");
  const int32_t* cp = ctx.data_ptr<int32_t>();
  int64_t max_ctx = 1;
  for (int64_t b = 0; b < B; ++b) max_ctx = std::max<int64_t>(max_ctx, cp[b]);
  split = std::max<int64_t>(split, block_size);
  const int64_t num_splits = (max_ctx + split - 1) / split;
  at::Tensor partial = at::empty({B * KVH * num_splits * (H / KVH) * (D + 2)}, q.options());
  at::Tensor out = at::empty_like(q);
  const int64_t max_blocks = tables.size(1);
  if (k_cache.scalar_type() == at::kBFloat16) {
    decode_attention_impl<uint16_t>(
        q.data_ptr<float>(), reinterpret_cast<const uint16_t*>(k_cache.data_ptr()),
        reinterpret_cast<const uint16_t*>(v_cache.data_ptr()), tables.data_ptr<int32_t>(), cp, B, H,
        KVH, D, block_size, max_blocks, static_cast<float>(scale), split, num_splits,
        partial.data_ptr<float>(), out.data_ptr<float>());
  } else {
    TORCH_CHECK(k_cache.scalar_type() == at::kFloat, "decode_attention: cache float32 or bfloat16");
    decode_attention_impl<float>(q.data_ptr<float>(), k_cache.data_ptr<float>(),
                                 v_cache.data_ptr<float>(), tables.data_ptr<int32_t>(), cp, B, H,
                                 KVH, D, block_size, max_blocks, static_cast<float>(scale), split,
                                 num_splits, partial.data_ptr<float>(), out.data_ptr<float>());
  }
  return out;
}

// Which instruction set this build was compiled for (the loader checks it against its choice).
int64_t isa() {
#if defined(__AVX512F__)
  return 512;
#else
  return 256;
#endif
}

}  // namespace
}  // namespace hearth

TORCH_LIBRARY(hearth, m) {
  m.def("qlinear(Tensor x, Tensor qweight, int qtype, int out_features, int in_features) -> Tensor",
        &hearth::qlinear);
  m.def("dequantize_rows(Tensor qweight, int qtype, int out_features, int in_features) -> Tensor",
        &hearth::dequantize_rows);
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &hearth::rms_norm);
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor",
        &hearth::add_rms_norm);
  m.def("silu_mul(Tensor gate_up) -> Tensor", &hearth::silu_mul);
  m.def("rope_write_kv(Tensor(a!) qkv, Tensor positions, Tensor cos, Tensor sin, Tensor(b!) k_cache, "
        "Tensor(c!) v_cache, Tensor slot_mapping, int num_heads, int num_kv_heads, int head_dim) -> ()",
        &hearth::rope_write_kv);
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, float scale, int split) -> Tensor",
        &hearth::decode_attention);
  m.def("isa() -> int", &hearth::isa);
}
