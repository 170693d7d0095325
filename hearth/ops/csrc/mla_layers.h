// Whole DeepSeek-V2/V3 / Kimi K2 decoder layers for steps of short queries (mla_decode_layers).
//
// A fragment of hearth's one kernel build: included by cpu_kernels.cpp inside
// namespace hearth::(anonymous), after the headers listed before it there.
//
// The same math as hearth/models/families/deepseek/model.py's modules on their short-query path,
// in the same order, one Python call per step instead of ~250 torch ops: a decode step of the 12-layer MLA
// bench model spent ~5 ms of its ~16 in Python dispatch and small tensor ops.
//   attention: [q_c | c | k_pe] = qlinear(norm(x)); q = q_b(norm(q_c)) (or q_proj(norm(x)));
//              the latent row [norm(c) | rope(k_pe)] into the cache; the query absorbed
//              (q_nope_h W_UK_h | rope(q_pe_h)); decode_attention over the latent rows as one
//              KV head; the output through W_UV_h; o_proj.
//   MLP:       dense (gate_up, SiLU-mul, down), or DeepSeek's MoE: router logits in fp32, the
//              grouped top-k (`route_grouped` in hearth/models/moe.py), moe_experts on the
//              packed experts, plus the shared experts' dense MLP.

// Each layer's weights and the model's shape: MlaLayer and MlaShape (fused_args.h).

// MLA's absorbed up-projections in a block format: out[t, h, :N] = x[t, h, :K] through head h's
// N rows of w ([H N, K] packed, head after head). The query side is W_UK_h^T (N = L rows of
// K = nope), the output side W_UV_h (N = v rows of K = L). Float32 (kv_b_proj's own copy)
// these were 25 of the 190 MB a step of the bench model reads; Q8_0 takes them to 6.6. The
// rows of x are gathered head-major so each head's rows are one qlinear tile input (and, with
// int8_act, one run of 8-bit activations), a task per (head, >= 16 KB of its rows).
void heads_qlinear(const QWeight& w, int64_t H, int64_t N, const float* x, int64_t T,
                   int64_t ldx_t, int64_t ldx_h, float* out, int64_t ldo_t, int64_t ldo_h,
                   int64_t threads, bool int8_act) {
  const int64_t K = w.K;
  TORCH_CHECK(w.N == H * N, "heads_qlinear: the packed weight must hold ", H, " x ", N, " rows");
  // the calling thread's buffers, addressed by pointer: a thread_local named inside the task
  // would be the worker thread's own (empty) one
  thread_local std::vector<float> xbuf, ybuf;
  xbuf.resize(H * T * K);
  ybuf.resize(H * T * N);
  float* xs = xbuf.data();
  float* ys = ybuf.data();
  for (int64_t h = 0; h < H; ++h)
    for (int64_t t = 0; t < T; ++t)
      std::memcpy(xs + (h * T + t) * K, x + t * ldx_t + h * ldx_h, K * sizeof(float));
  thread_local std::vector<int8_t> qx;
  thread_local std::vector<float> sc;
  int64_t dxe_row = 0;
  QAct act{};
  if (int8_act) act = quantize_act(xs, H * T, K, w.qtype, qx, sc, dxe_row);
  // a task: at least 16 KB of weight rows (W_UK^T's rows are 64 bytes for nope = 64: tasks of
  // 64 rows, 4 KB, spent more time starting than reading)
  constexpr int64_t NR = 4;
  const int64_t rows_per_task = std::max<int64_t>(64, 16384 / w.qs_row()) / NR * NR;
  const int64_t per_head = (N + rows_per_task - 1) / rows_per_task;
  parallel_tasks(H * per_head, [&](int64_t task) {
    const int64_t h = task / per_head, r0 = (task % per_head) * rows_per_task;
    group_rows(w, h, N, r0, std::min(N, r0 + rows_per_task), h * T, T, xs, ys,
               int8_act ? &act : nullptr, dxe_row);
  }, threads);
  for (int64_t h = 0; h < H; ++h)
    for (int64_t t = 0; t < T; ++t)
      std::memcpy(out + t * ldo_t + h * ldo_h, ys + (h * T + t) * N, N * sizeof(float));
}

// The op: x float32 [T, H, K] (any strides with a unit last one) -> [T, H, N].
at::Tensor mla_absorb(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                      const at::Tensor& m, int64_t qtype, int64_t rows, int64_t threads,
                      bool int8_act) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 3 && x.stride(2) == 1,
              "mla_absorb: x must be float32 [T, H, K] with a unit last stride");
  const int64_t T = x.size(0), H = x.size(1), K = x.size(2);
  const QWeight w = packed_weight(qs, d, m, qtype, H * rows, K, "mla_absorb");
  at::Tensor out = at::empty({T, H, rows}, x.options());
  if (T) heads_qlinear(w, H, rows, x.data_ptr<float>(), T, x.stride(0), x.stride(1),
                       out.data_ptr<float>(), H * rows, rows, threads, int8_act);
  return out;
}

// DeepSeek's router for T tokens (hearth/models/moe.py `route_grouped`, in fp32): scores by
// softmax or sigmoid; noaux_tc / group_limited_greedy keep only the experts of the topk_group
// best of n_group groups (worth: the sum of a group's two best biased scores / its best score);
// the top k of score + bias (ties: the lower id); weights are the unbiased scores,
// renormalised, times `scaling`. Each pick adds 1 to counts[e] when `counts` is given.
void route_grouped_rows(const float* logits, int64_t T, int64_t E, int64_t k, int64_t scoring,
                        int64_t method, int64_t n_group, int64_t topk_group, bool renormalize,
                        float scaling, const float* bias, float* wout, int64_t* iout,
                        int64_t* counts) {
  std::vector<float> score(E), choice(E), group_worth(std::max<int64_t>(n_group, 1));
  std::vector<int64_t> order(E), groups(std::max<int64_t>(n_group, 1));
  const int64_t per_group = E / std::max<int64_t>(n_group, 1);
  auto better = [](const std::vector<float>& v) {
    return [&v](int64_t a, int64_t b) { return v[a] > v[b] || (v[a] == v[b] && a < b); };
  };
  for (int64_t t = 0; t < T; ++t) {
    const float* l = logits + t * E;
    if (scoring == 1) {
      for (int64_t e = 0; e < E; ++e) score[e] = 1.0f / (1.0f + std::exp(-l[e]));
    } else {
      const float mx = *std::max_element(l, l + E);
      float sum = 0;
      for (int64_t e = 0; e < E; ++e) sum += (score[e] = std::exp(l[e] - mx));
      for (int64_t e = 0; e < E; ++e) score[e] /= sum;
    }
    for (int64_t e = 0; e < E; ++e) choice[e] = score[e] + (bias ? bias[e] : 0.0f);
    if (method != 0 && n_group > 1) {
      for (int64_t g = 0; g < n_group; ++g) {
        const float* c = choice.data() + g * per_group;
        float best = -INFINITY, second = -INFINITY;
        for (int64_t j = 0; j < per_group; ++j) {
          if (c[j] > best) {
            second = best;
            best = c[j];
          } else if (c[j] > second) {
            second = c[j];
          }
        }
        group_worth[g] = method == 2 ? best + second : best;
        groups[g] = g;
      }
      std::partial_sort(groups.begin(), groups.begin() + topk_group, groups.begin() + n_group,
                        better(group_worth));
      std::vector<bool> keep(n_group, false);
      for (int64_t j = 0; j < topk_group; ++j) keep[groups[j]] = true;
      for (int64_t e = 0; e < E; ++e)
        if (!keep[e / per_group]) choice[e] = -INFINITY;
    }
    for (int64_t e = 0; e < E; ++e) order[e] = e;
    std::partial_sort(order.begin(), order.begin() + k, order.end(), better(choice));
    float sum = 0;
    for (int64_t j = 0; j < k; ++j) sum += score[order[j]];
    for (int64_t j = 0; j < k; ++j) {
      const float w = score[order[j]];
      wout[t * k + j] = (renormalize ? w / (sum + 1e-20f) : w) * scaling;
      iout[t * k + j] = order[j];
      if (counts) ++counts[order[j]];
    }
  }
}

// One MLA decoder layer (see the top of this file); `residual` is updated in place (and is `x`
// itself for the first layer). Returns (the MLP's output, residual).
std::tuple<at::Tensor, at::Tensor> mla_decode_layer(
    const at::Tensor& x, const at::Tensor& residual_in, bool has_residual, const MlaLayer& w,
    const MlaShape& shape, const at::Tensor& counts, const at::Tensor& cos, const at::Tensor& sin,
    at::Tensor& cache, const ShortQueries& step, const KernelRun& run) {
  const int64_t H = shape.num_heads, nope = shape.qk_nope, R = shape.qk_rope;
  const int64_t V = shape.v_head, L = shape.kv_lora_rank;
  const int64_t q_lora = shape.q_lora_rank, qk = nope + R, D = L + R;
  const float eps = static_cast<float>(shape.eps);
  const int64_t T = x.size(0), hidden = x.size(1);
  const int64_t threads = run.threads;
  const bool int8_act = run.int8_act;
  at::Tensor residual = has_residual ? residual_in : x;
  at::Tensor normed = has_residual ? add_rms_norm(x, residual, w.in_norm, eps)
                                   : rms_norm(x, w.in_norm, eps);
  // [q_c |] c | k_pe, then the per-head query [T, H * (nope + R)]
  at::Tensor a = linear(normed, w.qkv_a, q_lora + D, run);
  const float* ap = a.data_ptr<float>();
  at::Tensor q;
  if (q_lora) {
    at::Tensor qc = at::empty({T, q_lora}, a.options());
    const float* wn = w.q_a_norm.data_ptr<float>();
    for (int64_t t = 0; t < T; ++t)
      rms_row(ap + t * (q_lora + D), wn, eps, q_lora, qc.data_ptr<float>() + t * q_lora);
    q = linear(qc, w.q, H * qk, run);
  } else {
    q = linear(normed, w.q, H * qk, run);
  }
  // RoPE (rotate-half, fp32) on k_pe and each head's q_pe; the latent row into the cache; the
  // absorbed query's rope part.
  at::Tensor q_lat = at::empty({T, H, D}, a.options());
  float* qlp = q_lat.data_ptr<float>();
  const float* qp = q.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t* pp = step.positions.data_ptr<int64_t>();
  const int64_t* slp = step.slot_mapping.data_ptr<int64_t>();
  const float* kv_norm = w.kv_a_norm.data_ptr<float>();
  const bool bf16_cache = cache.scalar_type() == at::kBFloat16;
  const int64_t half = R / 2;
  std::vector<float> row(D);
  auto rotate = [&](const float* in, float* out, int64_t t) {
    const float* c = cp + pp[t] * half;
    const float* s = sp + pp[t] * half;
#pragma omp simd
    for (int64_t j = 0; j < half; ++j) {
      const float x1 = in[j], x2 = in[j + half];
      out[j] = x1 * c[j] - x2 * s[j];
      out[j + half] = x2 * c[j] + x1 * s[j];
    }
  };
  for (int64_t t = 0; t < T; ++t) {
    const float* lat = ap + t * (q_lora + D) + q_lora;
    rms_row(lat, kv_norm, eps, L, row.data());
    rotate(lat + L, row.data() + L, t);
    if (bf16_cache) {
      uint16_t* dst = reinterpret_cast<uint16_t*>(cache.data_ptr()) + slp[t] * D;
#pragma omp simd
      for (int64_t j = 0; j < D; ++j) dst[j] = float_to_bf16(row[j]);
    } else {
      std::memcpy(cache.data_ptr<float>() + slp[t] * D, row.data(), D * sizeof(float));
    }
    for (int64_t h = 0; h < H; ++h)
      rotate(qp + (t * H + h) * qk + nope, qlp + (t * H + h) * D + L, t);
  }
  // q_lat_h[:L] = q_nope_h W_UK_h (kv_b_proj rows [h (nope + v), h (nope + v) + nope))
  const bool packed_absorb = w.uk.present();
  const float* kvb = w.kv_b.data_ptr<float>();
  if (packed_absorb)
    heads_qlinear(packed_weight(w.uk.qs, w.uk.d, w.uk.m, w.uk.qtype, H * L, nope,
                                "mla_decode_layers: W_UK"),
                  H, L, qp, T, H * qk, qk, qlp, H * D, D, threads, int8_act);
  else parallel_tasks(H, [&](int64_t h) {
    const float* wuk = kvb + h * (nope + V) * L;
    for (int64_t t = 0; t < T; ++t) std::fill_n(qlp + (t * H + h) * D, L, 0.0f);
    for (int64_t n = 0; n < nope; ++n) {
      const float* wr = wuk + n * L;
      for (int64_t t = 0; t < T; ++t) {
        const float s = qp[(t * H + h) * qk + n];
        float* o = qlp + (t * H + h) * D;
#pragma omp simd
        for (int64_t j = 0; j < L; ++j) o[j] += s * wr[j];
      }
    }
  }, threads);
  // [T, H, D], of which only [:L] (the latent's c) is V and written
  at::Tensor o_lat = decode_attention_v(q_lat, cache, cache, step.block_tables,
                                        step.context_lens, shape.scale, run.split, threads,
                                        step.query_lens, L % 16 ? 0 : L);
  // out_h = o_lat_h[:L] W_UV_h^T (kv_b_proj rows [h (nope + v) + nope, (h + 1)(nope + v)))
  at::Tensor attn = at::empty({T, H * V}, a.options());
  const float* olp = o_lat.data_ptr<float>();
  float* attp = attn.data_ptr<float>();
  if (packed_absorb)
    heads_qlinear(packed_weight(w.uv.qs, w.uv.d, w.uv.m, w.uv.qtype, H * V, L,
                                "mla_decode_layers: W_UV"),
                  H, V, olp, T, H * D, D, attp, H * V, V, threads, int8_act);
  else parallel_tasks(H, [&](int64_t h) {
    const float* wuv = kvb + (h * (nope + V) + nope) * L;
    for (int64_t j = 0; j < V; ++j) {
      const float* wr = wuv + j * L;
      for (int64_t t = 0; t < T; ++t) {
        const float* o = olp + (t * H + h) * D;
        float s = 0;
#pragma omp simd reduction(+ : s)
        for (int64_t l = 0; l < L; ++l) s += o[l] * wr[l];
        attp[t * H * V + h * V + j] = s;
      }
    }
  }, threads);
  at::Tensor h_out = linear(attn, w.o, hidden, run);
  at::Tensor normed2 = add_rms_norm(h_out, residual, w.post_norm, eps);
  auto dense_mlp = [&](int64_t width) {
    at::Tensor gu = linear(normed2, w.gate_up, 2 * width, run);
    return linear(silu_mul(gu), w.down, hidden, run);
  };
  if (!w.moe()) return {dense_mlp(shape.dense_width), residual};
  const at::Tensor& router = w.router;
  at::Tensor logits = at::mm(normed2, router.t());
  const int64_t E = router.size(0), k = shape.top_k;
  at::Tensor topk_w = at::empty({T, k}, a.options());
  at::Tensor topk_ids = at::empty({T, k}, a.options().dtype(at::kLong));
  route_grouped_rows(logits.data_ptr<float>(), T, E, k, shape.scoring, shape.topk_method,
                     shape.n_group, shape.topk_group, shape.renormalize != 0,
                     static_cast<float>(shape.routed_scaling_factor),
                     w.router_bias.numel() ? w.router_bias.data_ptr<float>() : nullptr,
                     topk_w.data_ptr<float>(), topk_ids.data_ptr<int64_t>(),
                     counts.numel() ? counts.data_ptr<int64_t>() : nullptr);
  // The shared experts join the routed experts' calls when they are one expert's shape and
  // formats (DeepSeek-V3, Kimi K2: one shared expert of the routed width); otherwise their own
  // dense MLP, added after.
  const int64_t I = w.w2.size(2);
  const bool has_shared = w.gate_up.present();
  const bool fold = has_shared && w.q13.present() && shape.shared_width == I &&
                    w.gate_up.qtype == w.q13.qtype && w.down.qtype == w.q2.qtype;
  SharedExpert shared;
  if (fold) {
    shared.w13 = packed_weight(w.gate_up.qs, w.gate_up.d, w.gate_up.m, w.gate_up.qtype,
                               2 * I, hidden, "mla_decode_layers: shared gate_up");
    shared.w2 = packed_weight(w.down.qs, w.down.d, w.down.m, w.down.qtype, hidden, I,
                              "mla_decode_layers: shared down");
  }
  at::Tensor out = moe_experts_impl(normed2, w.w13, w.w2, topk_w, topk_ids,
                                    shape.expert_start,
                                    {w.q13.qs, w.q13.d, w.q13.m, w.q2.qs, w.q2.d, w.q2.m},
                                    {w.q13.qtype, w.q2.qtype}, threads, int8_act,
                                    fold ? &shared : nullptr);
  if (has_shared && !fold) out.add_(dense_mlp(shape.shared_width));
  return {out, residual};
}

// Layers [0, n) of an MLA model for a step of short queries only, in one call. `weights` /
// `qtypes`: each layer's MlaLayer (fused_args.h) in turn; `dims` / `fdims`: one MlaShape;
// expert_counts[l]: the router's per-expert counts of layer l (or empty); caches[l]: its latent
// cache [blocks, block_size, 1, L + R], float32 or bfloat16. Returns (hidden, residual) after
// the last layer.
std::tuple<at::Tensor, at::Tensor> mla_decode_layers(
    const at::Tensor& x, const at::Tensor& residual_in, bool has_residual, at::TensorList weights,
    at::IntArrayRef qtypes, at::IntArrayRef dims, at::ArrayRef<double> fdims,
    at::TensorList expert_counts, const at::Tensor& rope_cos, const at::Tensor& rope_sin,
    at::TensorList caches, const at::Tensor& positions, const at::Tensor& slot_mapping,
    const at::Tensor& block_tables, const at::Tensor& context_lens,
    const std::optional<at::Tensor>& query_lens, int64_t split, int64_t threads, bool int8_act) {
  const int64_t n = static_cast<int64_t>(caches.size());
  TORCH_CHECK(n >= 1 && static_cast<int64_t>(weights.size()) == MlaLayer::kTensors * n &&
                  static_cast<int64_t>(qtypes.size()) == MlaLayer::kTypes * n &&
                  static_cast<int64_t>(expert_counts.size()) == n,
              "mla_decode_layers: per layer ", MlaLayer::kTensors, " tensors, ", MlaLayer::kTypes,
              " types, a counts tensor and a cache");
  const MlaShape shape = MlaShape::read(dims, fdims);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "mla_decode_layers: x float32 [T, hidden]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong &&
                  positions.numel() == x.size(0) && slot_mapping.numel() == x.size(0),
              "mla_decode_layers: int64 positions and slots, one per token");
  TORCH_CHECK(rope_cos.scalar_type() == at::kFloat && rope_sin.scalar_type() == at::kFloat &&
                  rope_cos.is_contiguous() && rope_sin.is_contiguous() &&
                  rope_cos.size(1) * 2 == shape.qk_rope,
              "mla_decode_layers: float32 cos/sin tables [positions, rope / 2]");
  const int64_t D = shape.kv_lora_rank + shape.qk_rope;
  std::vector<MlaLayer> layers;
  for (int64_t l = 0; l < n; ++l) {
    const at::Tensor& c = caches[l];
    TORCH_CHECK(c.is_contiguous() && c.dim() == 4 && c.size(2) == 1 && c.size(3) == D &&
                    (c.scalar_type() == at::kFloat || c.scalar_type() == at::kBFloat16),
                "mla_decode_layers: cache ", l, " must be float32 or bfloat16 [blocks, block, 1, ",
                D, "]");
    const MlaLayer& w = layers.emplace_back(MlaLayer::read(weights, qtypes, l));
    TORCH_CHECK(w.kv_b.scalar_type() == at::kFloat && w.kv_b.is_contiguous() &&
                    w.kv_b.numel() ==
                        shape.num_heads * (shape.qk_nope + shape.v_head) * shape.kv_lora_rank,
                "mla_decode_layers: kv_b_proj float32 [H (nope + v), L] in layer ", l);
    if (w.uk.present()) {  // the packed absorbed up-projections: checked before any write
      packed_weight(w.uk.qs, w.uk.d, w.uk.m, w.uk.qtype, shape.num_heads * shape.kv_lora_rank,
                    shape.qk_nope, "mla_decode_layers: W_UK");
      packed_weight(w.uv.qs, w.uv.d, w.uv.m, w.uv.qtype, shape.num_heads * shape.v_head,
                    shape.kv_lora_rank, "mla_decode_layers: W_UV");
    }
  }
  const ShortQueries step{positions, slot_mapping, block_tables, context_lens, query_lens};
  const KernelRun run{split, threads, int8_act};
  at::Tensor hidden = x, residual = residual_in;
  bool has = has_residual;
  for (int64_t l = 0; l < n; ++l) {
    at::Tensor cache = caches[l];
    std::tie(hidden, residual) =
        mla_decode_layer(hidden, residual, has, layers[l], shape, expert_counts[l], rope_cos,
                         rope_sin, cache, step, run);
    has = true;
  }
  return {hidden, residual};
}
