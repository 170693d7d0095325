// Shared by every kernel family: ggml block constants, bf16/fp8 conversions, the task pool,
// ISA helpers.
//
// A fragment of hearth's one kernel build: included by cpu_kernels.cpp inside
// namespace hearth::(anonymous), after the headers listed before it there.

constexpr int64_t kQK = 32;  // elements per ggml block
// ggml type ids
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14, kMXFP4 = 39;
constexpr int64_t kQK_K = 256;  // elements per k-quant super-block

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

#if defined(__AVX2__)
// 2^x on 8 lanes for x <= ~0 (scores minus their running max); x below -126 gives ~2^-126
// (callers zero masked entries), the relative error ~2e-7 as exp2_ps's.
inline __m256 exp2_ps8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-126.0f));
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_mul_ps(_mm256_sub_ps(x, n), _mm256_set1_ps(0.69314718055994531f));
  __m256 p = _mm256_set1_ps(1.0f / 720.0f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// fast_exp on 8 lanes (the same operations; the scalar loop over it did not vectorize): the
// clamp keeps x log2(e) within [-125.5, 127], so exp2_ps8's own floor never applies.
inline __m256 fast_exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  return exp2_ps8(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)));
}
#endif

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

// Whether the attention kernels take AVX512-BF16 dot products for bf16 caches (decode_attention.h:
// MLA's wide latent rows): an AVX-512 build on a CPU that has them.
bool bf16_dot_products() {
#if defined(__AVX512F__)
  static const bool yes = __builtin_cpu_supports("avx512bf16");
  return yes;
#else
  return false;
#endif
}
