// Decode attention over the paged cache (short queries, split along the context).
//
// A fragment of hearth's one kernel build: included by cpu_kernels.cpp inside
// namespace hearth::(anonymous), after the headers listed before it there.

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
    int64_t i = 0;
#if defined(__AVX2__)
    __m256 sum8 = _mm256_setzero_ps();
    for (; i + 8 <= m; i += 8) {
      const __m256 e = fast_exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + i), _mm256_set1_ps(mx)));
      _mm256_storeu_ps(sc + i, e);
      sum8 = _mm256_add_ps(sum8, e);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, sum8);
    for (int j = 0; j < 8; ++j) sum += lanes[j];
#endif
    for (; i < m; ++i) {
      sc[i] = fast_exp(sc[i] - mx);
      sum += sc[i];
    }
    for (int64_t i = m; i < n; ++i) sc[i] = 0;
    part[h * pstride] = mx;
    part[h * pstride + 1] = sum;
  }
}

// Read ahead into L2 the cache records (`bytes` each: every KV head's row of a token) of tokens
// [a, b) of a work item, off[t - t0] the records' element offsets (elem bytes each). The splits'
// blocks are scattered over the pool, so the hardware prefetchers see short runs; a software
// prefetch a few tokens ahead lets the DRAM reads overlap the dot products (2-core EPYC, 30
// layers of 9 x 64 heads over 32k tokens, 2 threads: scattered tables bf16 76 -> 49 ms, int8
// 62 -> 25; tables in pool order bf16 51 -> 38). MLA's wide rows (long runs the hardware
// follows) got slower with it (21 -> 27 ms at 16k) and take none.
inline void prefetch_records(const void* base, const int64_t* off, int64_t a, int64_t b,
                             int64_t elem, int64_t bytes) {
  const char* p = static_cast<const char*>(base);
  for (int64_t t = a; t < b; ++t)
    for (int64_t x = 0; x < bytes; x += 64) _mm_prefetch(p + off[t] * elem + x, _MM_HINT_T1);
}

// One work item: query heads [g*G, (g+1)*G) of request b over context tokens [t0, t1).
// Writes per head: part[h] = (max score, sum of exp, unnormalized output[D]).
template <typename KV>
void attend_generic(const float* qg, const KV* kc, const KV* vc, const int64_t* off, int64_t t0,
                    int64_t t1, int64_t G, int64_t KVH, int64_t g, int64_t D, int64_t Dv,
                    float scale, const int64_t* lim, float* part, float* scores) {
  const int64_t n = t1 - t0, pstride = D + 2, rs = row_stride<KV>(D);
  const int64_t row = rs * int64_t{sizeof(KV)};
  constexpr int64_t kAhead = 16;  // tokens read ahead (prefetch_records)
  prefetch_records(kc + g * rs, off - t0, t0, std::min(t1, t0 + kAhead), sizeof(KV), row);
  for (int64_t t = t0; t < t1; ++t) {
    if (t + kAhead < t1) prefetch_records(kc + g * rs, off - t0, t + kAhead, t + kAhead + 1, sizeof(KV), row);
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
    for (int64_t j = 0; j < Dv; ++j) part[h * pstride + 2 + j] = 0;
  prefetch_records(vc + g * rs, off - t0, t0, std::min(t1, t0 + kAhead), sizeof(KV), row);
  for (int64_t t = t0; t < t1; ++t) {
    if (t + kAhead < t1) prefetch_records(vc + g * rs, off - t0, t + kAhead, t + kAhead + 1, sizeof(KV), row);
    const KV* v = vc + off[t - t0] + g * rs;
    const float vs = row_scale(v, D);
    for (int64_t h = 0; h < G; ++h) {
      const float p = scores[h * n + (t - t0)] * vs;
      float* o = part + h * pstride + 2;
#pragma omp simd
      for (int64_t j = 0; j < Dv; ++j) o[j] += p * load_kv(v, j);
    }
  }
}

// The per-ISA row kernels the work items below dispatch to.
#include "decode_attention_avx512.h"
#include "decode_attention_avx2.h"

// Merge the splits of query head h of request b into out[b, h].
// `sink`: a learned logit (gpt-oss) that joins the softmax's denominator with no value, or -inf.
inline void merge_splits(const float* base, int64_t num_splits, int64_t stride, int64_t D, float* o,
                         float sink = -INFINITY) {
  float mx = sink;
  for (int64_t s = 0; s < num_splits; ++s) mx = std::max(mx, base[s * stride]);
  for (int64_t j = 0; j < D; ++j) o[j] = 0;
  float denom = sink > -INFINITY ? fast_exp(sink - mx) : 0.0f;
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
                           int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t Dv,
                           int64_t block_size, int64_t max_blocks, float scale, int64_t split,
                           int64_t num_splits, int64_t max_q, float* partial, float* out,
                           int64_t threads, const float* sinks = nullptr, int64_t window = 0) {
  const int64_t G = H / KVH, pstride = D + 2, RG = max_q * G;  // RG: rows per (item, kv head)
  auto part_at = [&](int64_t b, int64_t g, int64_t s) {
    return partial + ((b * KVH + g) * num_splits + s) * RG * pstride;
  };
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b)
    total += (window > 0 ? std::min<int64_t>(ctx[b], window) : ctx[b]) * int64_t{qlen[b]};
  // One task per (request, context split), covering every KV head: a token's K/V rows of all
  // heads are adjacent in the cache, so the heads read the split's bytes from DRAM once (one
  // task per head re-read each cache line per head: 9 GB/s instead of ~20 at 6k tokens).
  auto item_fn = [&](int64_t item) {
    thread_local std::vector<float> scores, qbuf;
    thread_local std::vector<int64_t> lim, offs;
    const int64_t b = item / num_splits, s = item % num_splits, ql = qlen[b];
    // a sliding window (one query per request: decode_attention_v checks) starts the splits at
    // the first key the query sees
    const int64_t first = window > 0 ? std::max<int64_t>(0, ctx[b] - window) : 0;
    const int64_t t0 = first + s * split, t1 = std::min<int64_t>(ctx[b], t0 + split), R = ql * G;
    offs.resize(std::max<int64_t>(0, t1 - t0));  // each token's offset in the cache (all heads)
    for_each_slot(tables + b * max_blocks, block_size, t0, t1,
                  [&](int64_t t, int64_t slot) { offs[t - t0] = slot * KVH * row_stride<KV>(D); });
    lim.resize(R);
    for (int64_t j = 0; j < ql; ++j)
      for (int64_t h = 0; h < G; ++h) lim[j * G + h] = ctx[b] - ql + j + 1 - t0;
#if defined(__AVX512F__)
    constexpr bool avx512 = true;
#else
    constexpr bool avx512 = false;
#endif
#if defined(__AVX512F__) || defined(__AVX2__)
    if ((avx512 ? D == 64 || D == 128 : D % 64 == 0 && KVH > 1) && Dv == D && t0 < t1) {
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
#if defined(__AVX512F__)
      if (D == 64)
        attend_heads_avx512<KV, 4>(qgs.data(), kc, vc, offs.data(), t0, t1, R, KVH, scale, lim.data(),
                                   parts.data(), scores.data());
      else
        attend_heads_avx512<KV, 8>(qgs.data(), kc, vc, offs.data(), t0, t1, R, KVH, scale, lim.data(),
                                   parts.data(), scores.data());
#else
      if constexpr (std::is_same_v<KV, uint16_t>)
        attend_heads_bf16_avx2(qgs.data(), kc, vc, offs.data(), t0, t1, R, KVH, D, scale,
                               lim.data(), parts.data(), scores.data());
      else
        attend_heads_avx2<KV>(qgs.data(), kc, vc, offs.data(), t0, t1, R, KVH, D, scale,
                              lim.data(), parts.data(), scores.data());
#endif
      return;
    }
#endif
#if defined(__AVX512F__)
    if constexpr (!scaled_rows<KV>) {  // (MLA refuses the int8 and fp8 formats)
      if (KVH == 1 && D % 16 == 0 && t0 < t1) {  // MLA's latent row (absorbed decode)
        const float* qg = q + qstart[b] * H * D;  // rows j * G + h: already in that order
        scores.resize(R * (t1 - t0));
        attend_wide_avx512<KV>(qg, kc, vc, offs.data(), t0, t1, R, D, Dv, scale, lim.data(),
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
      attend_generic<KV>(qg, kc, vc, offs.data(), t0, t1, R, KVH, g, D, Dv, scale,
                 lim.data(), part, scores.data());
    }
  };
  auto merge_fn = [&](int64_t b) {
    for (int64_t j = 0; j < qlen[b]; ++j)
      for (int64_t h = 0; h < H; ++h)
        merge_splits(part_at(b, h / G, 0) + (j * G + h % G) * pstride, num_splits, RG * pstride, Dv,
                     out + ((qstart[b] + j) * H + h) * D, sinks ? sinks[h] : -INFINITY);
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
// v_dim (< D, a multiple of 16; mla_layers.h): only the first v_dim values of each row are V
// -- MLA's latent [c | k_pe], whose rope part is a key only -- and only out[..., :v_dim] is
// written (0: all D).
at::Tensor decode_attention_v(const at::Tensor& q_in, const at::Tensor& k_cache,
                              const at::Tensor& v_cache, const at::Tensor& block_tables_in,
                              const at::Tensor& context_lens_in, double scale, int64_t split,
                              int64_t threads, const std::optional<at::Tensor>& query_lens_in,
                              int64_t v_dim, const std::optional<at::Tensor>& sinks_in = std::nullopt,
                              int64_t window = 0) {
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
  const int64_t Dv = v_dim > 0 ? v_dim : D;
  TORCH_CHECK(Dv == D || (Dv < D && Dv % 16 == 0), "decode_attention: v_dim ", Dv,
              " must be the head size or a multiple of 16 below it");
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
  TORCH_CHECK(window >= 0 && (window == 0 || max_q == 1),
              "decode_attention: a window takes one query per request (and must be >= 0)");
  at::Tensor sinks;
  if (sinks_in.has_value() && sinks_in->defined()) {
    sinks = sinks_in->to(at::kFloat).contiguous();
    TORCH_CHECK(sinks.numel() == H, "decode_attention: one sink per query head (", H, "), got ",
                sinks.numel());
  }
  const float* sp = sinks.defined() ? sinks.data_ptr<float>() : nullptr;
  if (window > 0) max_ctx = std::min<int64_t>(max_ctx, window);  // what a request's splits cover
  split = std::max<int64_t>(split, block_size);
  // Fewer (request, split) items than threads leave cores idle. Where a request's context is
  // work enough for it (MLA: 16 query heads on one 320-wide bf16 latent row at 200 tokens, 36 us
  // on one thread -> 26 on two), the splits are cut so every thread gets one; a dense model's
  // short contexts (a few us) stay one item, with no parallel region.
  const int64_t nt = std::min<int64_t>(threads, at::get_num_threads());
  if (B * ((max_ctx + split - 1) / split) < nt && max_ctx * H * D >= nt * (int64_t{1} << 18)) {
    const int64_t per = (nt + B - 1) / B;  // items wanted per request
    split = std::max<int64_t>(block_size, ((max_ctx + per - 1) / per + block_size - 1) /
                                              block_size * block_size);
  }
  // The partial results hold (max, sum, output row) per query row, head and split. Many rows
  // over a long context (DeepSeek-V3's 128 heads of 576 in a 16-token verify step at 128k:
  // 1.2 GB, written and page-faulted per layer) take fewer, longer splits instead, so they stay
  // under kPartialBytes (each item's scores grow to rows x split floats), keeping at least a
  // split per thread.
  constexpr int64_t kPartialBytes = int64_t{64} << 20;
  const int64_t split_bytes = B * max_q * H * (D + 2) * int64_t{sizeof(float)};
  if ((max_ctx + split - 1) / split * split_bytes > kPartialBytes) {
    const int64_t most = std::max<int64_t>(kPartialBytes / split_bytes, (nt + B - 1) / B);
    split = std::max<int64_t>(split, ((max_ctx + most - 1) / most + block_size - 1) / block_size *
                                         block_size);
  }
  const int64_t num_splits = (max_ctx + split - 1) / split;
  at::Tensor partial = at::empty({B * KVH * num_splits * max_q * (H / KVH) * (D + 2)}, q.options());
  at::Tensor out = at::empty_like(q);
  const int64_t max_blocks = tables.size(1);
  auto run = [&](auto* kc, auto* vc) {
    decode_attention_impl(q.data_ptr<float>(), kc, vc, tables.data_ptr<int32_t>(), cp, qp,
                          qstart.data(), B, H, KVH, D, Dv, block_size, max_blocks,
                          static_cast<float>(scale), split, num_splits, max_q,
                          partial.data_ptr<float>(), out.data_ptr<float>(), threads, sp, window);
  };
  if (k_cache.scalar_type() == at::kChar) {
    run(act_ptr<const int8_t>(k_cache), act_ptr<const int8_t>(v_cache));
  } else if (is_fp8_cache(k_cache)) {
    run(act_ptr<const e4m3>(k_cache), act_ptr<const e4m3>(v_cache));
  } else if (k_cache.scalar_type() == at::kBFloat16) {
    decode_attention_impl<uint16_t>(
        q.data_ptr<float>(), reinterpret_cast<const uint16_t*>(k_cache.data_ptr()),
        reinterpret_cast<const uint16_t*>(v_cache.data_ptr()), tables.data_ptr<int32_t>(), cp, qp,
        qstart.data(), B, H, KVH, D, Dv, block_size, max_blocks, static_cast<float>(scale), split,
        num_splits, max_q, partial.data_ptr<float>(), out.data_ptr<float>(), threads, sp, window);
  } else {
    TORCH_CHECK(k_cache.scalar_type() == at::kFloat,
                "decode_attention: cache float32, bfloat16, int8 or float8_e4m3fn");
    decode_attention_impl<float>(q.data_ptr<float>(), k_cache.data_ptr<float>(),
                                 v_cache.data_ptr<float>(), tables.data_ptr<int32_t>(), cp, qp,
                                 qstart.data(), B, H, KVH, D, Dv, block_size, max_blocks,
                                 static_cast<float>(scale), split, num_splits, max_q,
                                 partial.data_ptr<float>(), out.data_ptr<float>(), threads, sp,
                                 window);
  }
  return out;
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, double scale, int64_t split,
                            int64_t threads, const std::optional<at::Tensor>& query_lens,
                            const std::optional<at::Tensor>& sinks = std::nullopt,
                            int64_t window = 0) {
  return decode_attention_v(q, k_cache, v_cache, block_tables, context_lens, scale, split,
                            threads, query_lens, 0, sinks, window);
}
