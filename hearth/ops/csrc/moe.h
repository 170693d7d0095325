// moe_experts: the expert part of a Mixture-of-Experts layer in one call.
//
//   out[t] = sum_j  w[t, j] * down_e( silu(gate_e x_t) * up_e x_t ),   e = ids[t, j]
//
// Included by cpu_kernels.cpp (one build, probed per ISA): it reuses qlinear's tiles, the
// task pool and the fast exp. The (token, slot) pairs of a step are sorted by expert (a counting
// sort), the tokens of each active expert gathered into one block, and only the active experts'
// weights are read:
//
//   pairs sorted by expert:  | e3: t0 t5 | e7: t0 t2 t5 | e9: t2 |      (P = T * k pairs)
//   xs [P, H]   gathered token rows, in that order (with int8_act quantized to 8 bits per
//               32-block, qlinear's VNNI path, for gu and again for act)
//   gu [P, 2I]  xs against each expert's [gate | up] rows    (quantized: qlinear tiles; float:
//   act [P, I]  silu(gate) * up (or gpt-oss's clamped SwiGLU)  one GEMM per expert, at::mm)
//   ys [P, H]   act against each expert's down rows
//   out[t]      sum over t's slots j in slot order of w[t, j] * ys[pos(t, j)]  (deterministic)
//
// Optional per-expert biases (gpt-oss) join gu and ys before the activation and the combine.
// Weights: w13 [E, 2I, H] and w2 [E, H, I] float32 or bfloat16 (many-row steps: GEMMs), or the
// same rows in a ggml block format (few-row steps: a task per (expert, 256 weight rows), so a
// decode step spreads its k experts' rows over every thread; with 8-bit activations a Q4_K /
// Q6_K expert of kExpertGemmMinPairs pairs or more through the AVX2 K-quant GEMM, else one with
// more than 32 pairs (MXFP4 with 8-bit activations: 256) by float tiles decoded from its
// blocks, expert_decoded_tiles). Pairs
// routed to experts outside [expert_start, expert_start + E) belong to another expert-parallel
// rank and are skipped.

struct ExpertPairs {
  std::vector<int64_t> offset;  // [E + 1] first sorted pair of each expert
  std::vector<int64_t> token;   // [P] token of each sorted pair
  std::vector<int64_t> pos;     // [T * k] sorted position of pair (t, j), -1 if not local
};

ExpertPairs sort_pairs(const int64_t* ids, int64_t T, int64_t k, int64_t E, int64_t first) {
  ExpertPairs s;
  s.offset.assign(E + 1, 0);
  s.pos.assign(T * k, -1);
  for (int64_t p = 0; p < T * k; ++p) {
    const int64_t e = ids[p] - first;
    if (e >= 0 && e < E) ++s.offset[e + 1];
  }
  for (int64_t e = 0; e < E; ++e) s.offset[e + 1] += s.offset[e];
  s.token.resize(s.offset[E]);
  std::vector<int64_t> next(s.offset.begin(), s.offset.end() - 1);
  for (int64_t p = 0; p < T * k; ++p) {
    const int64_t e = ids[p] - first;
    if (e < 0 || e >= E) continue;
    s.pos[p] = next[e]++;
    s.token[s.pos[p]] = p / k;
  }
  return s;
}

// Expert e's rows of a packed weight holding E experts' rows stacked ([E * rows, K]).
QWeight expert_rows(const QWeight& w, int64_t e, int64_t rows) {
  QWeight v = w;
  v.N = rows;
  v.qs = w.qs + e * rows * w.qs_row();
  v.d = w.d + e * rows * w.d_row();
  v.m = w.m ? w.m + e * rows * w.nb : nullptr;
  v.ks = w.ks ? w.ks + e * rows * w.ks_row() : nullptr;
  return v;
}

// Weight rows [r0, r1) of group g (rows [g g_rows, (g + 1) g_rows) of `w`) against the M rows
// of `in` (float [., K], or with `act` its 8-bit form) starting at row p0, into out [., g_rows]
// at row p0: an expert's share of a step's pairs (experts_qlinear), or an MLA head's rows
// (heads_qlinear, mla_layers.h).
void group_rows(const QWeight& w, int64_t g, int64_t g_rows, int64_t r0, int64_t r1, int64_t p0,
                int64_t M, const float* in, float* out, const QAct* act, int64_t dxe_row) {
  constexpr int64_t NR = 4;
  const QWeight wg = expert_rows(w, g, g_rows);
  float* o = out + p0 * g_rows;
  int64_t n = r0;
  if (act) {  // this group's rows of the quantized activations
    const QAct a = act_rows(*act, p0, M, dxe_row);
    for (; n + NR <= r1; n += NR) qlinear_rows_i8<NR>(wg, n, a, o);
    for (; n < r1; ++n) qlinear_rows_i8<1>(wg, n, a, o);
    return;
  }
  const float* x = in + p0 * w.K;
  for (; n + NR <= r1; n += NR) qlinear_rows<NR>(wg, n, x, M, o);
  for (; n < r1; ++n) qlinear_rows<1>(wg, n, x, M, o);
}

// An expert with more than this many pairs in a step multiplies by float tiles decoded from
// its blocks (decode_row: the same values), one GEMM per tile, as a dense layer's prompt step
// does past QLINEAR_MAX_ROWS (hearth/models/layers.py); fewer pairs run qlinear's tiles. Only
// blocks-only experts (every step packed) meet it: others take their float stacks for steps
// of more than 32 rows, where no expert has more than 32 pairs.
constexpr int64_t kDecodedTileMinPairs = 33;
// MXFP4 with 8-bit activations: the pairs tile runs ~66 GOPS at any row count (one thread, a
// gpt-oss [5760, 2880] weight), decoded float tiles + at::mm 45 at 64 rows and 66 at 256, so
// such experts take the tiles up to 256 pairs.
constexpr int64_t kDecodedTileMinPairsMxfp4A8 = 257;
constexpr int64_t kDecodedTileBytes = 4 << 20;  // each tile's float32 values, about

// Expert e's rows of `w` (w_rows of them) against its pairs' float rows of `in` [n, K] from
// row p0, into out [n, w_rows] at row p0: tiles of decoded rows, each decoded once (in
// parallel) and multiplied by all n rows (at::mm).
void expert_decoded_tiles(const QWeight& w, int64_t e, int64_t w_rows, int64_t p0, int64_t n,
                          const float* in, float* out, int64_t threads) {
  const QWeight we = expert_rows(w, e, w_rows);
  const int64_t K = w.K, tile = std::max<int64_t>(16, kDecodedTileBytes / (4 * K));
  const at::Tensor x = at::from_blob(const_cast<float*>(in) + p0 * K, {n, K}, at::kFloat);
  at::Tensor y = at::from_blob(out + p0 * w_rows, {n, w_rows}, at::kFloat);
  at::Tensor values = at::empty({std::min(tile, w_rows), K}, at::kFloat);
  for (int64_t r0 = 0; r0 < w_rows; r0 += tile) {
    const int64_t r1 = std::min(w_rows, r0 + tile);
    float* v = values.data_ptr<float>();
    parallel_tasks((r1 - r0 + 15) / 16, [&](int64_t task) {
      std::vector<float> sd(w.nb), sm(w.nb);
      for (int64_t r = r0 + task * 16; r < std::min(r1, r0 + (task + 1) * 16); ++r)
        decode_row(we, r, v + (r - r0) * K, sd.data(), sm.data());
    }, threads);
    y.narrow(1, r0, r1 - r0).copy_(at::mm(x, values.narrow(0, 0, r1 - r0).t()));
  }
}

// With 8-bit activations, a Q4_K or Q6_K expert with at least this many pairs in a step
// multiplies through the K-quant GEMM (qlinear_q4k_gemm / qlinear_q6k_gemm: a task's panel of
// 64 weight rows unpacked once for all its pairs), where the build has it; fewer pairs run the
// tiles, which read each weight row once per 4 pairs and once per pair past those. Below the
// dense layers' line (8): a Qwen3-30B-A3B layer (benchmarks/q4k_prefill.py --moe, 1 thread) at
// 64 tokens ran 47 GOPS with the line at 8, 52-55 at 3-6, 54 at 2 (3 also best with Q6_K down).
constexpr int64_t kExpertGemmMinPairs = 3;

// Whether `qtype` experts with 8-bit activations take the K-quant GEMM (many pairs).
bool expert_gemm(int64_t qtype) { return kKQuantGemm && (qtype == kQ4_K || qtype == kQ6_K); }

// The rows [rows, K] of a step's projection quantized to 8 bits for experts_qlinear: each
// active expert's pairs in the layout its path reads (the GEMM's panel order for an expert of
// kExpertGemmMinPairs pairs or more, else the tiles'), the rows after the pairs (the shared
// expert's) in the tiles'. Every layout of a K-quant's activations has the same scales (one per
// super-block) and row stride (K bytes), so one buffer holds them all, each row quantized once;
// chunks of 64 rows over the threads. Q6_K's GEMM rows also get their group sums `X` [rows,
// K / 16] (q6k_group_sums). Other formats: quantize_act (one layout).
QAct quantize_expert_rows(const float* x, int64_t rows, int64_t K, int64_t qtype,
                          const ExpertPairs& s, std::vector<int8_t>& q, std::vector<float>& sc,
                          std::vector<int16_t>& X, int64_t& dxe_row, int64_t threads) {
  if (!expert_gemm(qtype)) return quantize_act(x, rows, K, qtype, q, sc, dxe_row);
  const int tiles = act_layout(qtype), panel = qtype == kQ4_K ? kQ4KPanel : kQ6KPanel;
  const int64_t nb = K / kQK, stride = act_stride(tiles, nb), G = act_group(tiles);
  TORCH_CHECK(stride == K && act_group(panel) == G, "moe_experts: K-quant activation layouts");
  dxe_row = (nb + G - 1) / G * 16;
  q.resize(rows * stride);
  sc.resize(rows * (2 * nb + dxe_row));
  if (qtype == kQ6_K) X.resize(rows * nb * 2);
  float *dx = sc.data(), *xs = dx + rows * nb, *dxe = xs + rows * nb;
  struct Chunk {
    int64_t p0, n;
    bool gemm;
  };
  std::vector<Chunk> chunks;
  auto add = [&](int64_t p0, int64_t p1, bool gemm) {
    for (; p0 < p1; p0 += 64) chunks.push_back({p0, std::min<int64_t>(64, p1 - p0), gemm});
  };
  const int64_t E = s.offset.size() - 1;
  for (int64_t e = 0; e < E; ++e)
    add(s.offset[e], s.offset[e + 1], s.offset[e + 1] - s.offset[e] >= kExpertGemmMinPairs);
  add(s.offset[E], rows, false);
  parallel_tasks(chunks.size(), [&](int64_t c) {
    const int64_t p0 = chunks[c].p0, n = chunks[c].n;
    quantize_rows(x + p0 * K, n, K, chunks[c].gemm ? panel : tiles, q.data() + p0 * stride,
                  dx + p0 * nb, xs + p0 * nb, dxe + p0 * dxe_row, kQK_K);
    if (chunks[c].gemm && qtype == kQ6_K)
      q6k_group_sums(QAct{n, nb, stride, q.data() + p0 * stride, dx + p0 * nb, xs + p0 * nb,
                          dxe + p0 * dxe_row},
                     nb / 8, X.data() + p0 * nb * 2);
  }, rows >= 128 ? threads : 1);
  return QAct{rows, nb, stride, q.data(), dx, xs, dxe};
}

// rows [P, N] of `in` (float, or with `act` its 8-bit form) through each expert's rows of `w`
// into out [P, w_rows]: one task per (active expert, 256 weight rows). An expert with
// kExpertGemmMinPairs pairs or more with 8-bit activations in Q4_K / Q6_K: a task per (expert,
// 64 weight rows) through the K-quant GEMM (`act` from quantize_expert_rows, `X` its Q6_K
// group sums), these tasks first; otherwise one with kDecodedTileMinPairs pairs or more through
// decoded float tiles (float `in`). With `shared` (the always-on shared expert, the same row
// count and format as one routed expert), its rows run against rows [P, P + T) of `in` in the
// same task pool (one parallel region for all: the shared expert's own pair of calls had run at
// ~17 GB/s, their ~0.8 MB too little for a region).
void experts_qlinear(const QWeight& w, int64_t w_rows, const ExpertPairs& s, const float* in,
                     float* out, int64_t threads, const QAct* act = nullptr,
                     int64_t dxe_row = 0, const QWeight* shared = nullptr, int64_t shared_m = 0,
                     const int16_t* X = nullptr) {
  constexpr int64_t kRowsPerTask = 256, kGemmRowsPerTask = 64;
  const int64_t E = s.offset.size() - 1, tasks_per_expert = (w_rows + kRowsPerTask - 1) / kRowsPerTask;
  const int64_t gemm_tasks_per_expert = (w_rows + kGemmRowsPerTask - 1) / kGemmRowsPerTask;
  const int64_t P = s.offset[E];
  const bool gemm_ok = act && expert_gemm(w.qtype);
  std::vector<int64_t> active, decoded, gemm;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = s.offset[e + 1] - s.offset[e];
    if (gemm_ok && n >= kExpertGemmMinPairs)
      gemm.push_back(e);
    else if (!gemm_ok && n >= (act && w.qtype == kMXFP4 ? kDecodedTileMinPairsMxfp4A8
                                                         : kDecodedTileMinPairs))
      decoded.push_back(e);
    else if (n > 0)
      active.push_back(e);
  }
  for (int64_t e : decoded)
    expert_decoded_tiles(w, e, w_rows, s.offset[e], s.offset[e + 1] - s.offset[e], in, out,
                         threads);
  const int64_t gemms = gemm.size() * gemm_tasks_per_expert;
  const int64_t routed = active.size() * tasks_per_expert;
  const int64_t extra = shared && shared_m > 0 ? tasks_per_expert : 0;
  parallel_tasks(gemms + routed + extra, [&](int64_t task) {
    if (task < gemms) {
      const int64_t e = gemm[task / gemm_tasks_per_expert], p0 = s.offset[e];
      const int64_t n0 = (task % gemm_tasks_per_expert) * kGemmRowsPerTask;
      const int64_t n1 = std::min(w_rows, n0 + kGemmRowsPerTask);
      const QAct a = act_rows(*act, p0, s.offset[e + 1] - p0, dxe_row);
      const QWeight we = expert_rows(w, e, w_rows);  // out rows: w_rows apart, from p0
      if (w.qtype == kQ4_K)
        qlinear_q4k_gemm(we, n0, n1, a, out + p0 * w_rows);
      else
        qlinear_q6k_gemm(we, n0, n1, a, X + p0 * (w.nb / 8) * 16, out + p0 * w_rows);
      return;
    }
    task -= gemms;
    const bool mine = task >= routed;  // the shared expert's rows
    const int64_t local = mine ? task - routed : task;
    const int64_t r0 = (local % tasks_per_expert) * kRowsPerTask;
    const int64_t r1 = std::min(w_rows, r0 + kRowsPerTask);
    if (mine) {
      group_rows(*shared, 0, w_rows, r0, r1, P, shared_m, in, out, act, dxe_row);
      return;
    }
    const int64_t e = active[local / tasks_per_expert];
    const int64_t p0 = s.offset[e];
    group_rows(w, e, w_rows, r0, r1, p0, s.offset[e + 1] - p0, in, out, act, dxe_row);
  }, threads);
}

// rows[i] of x (any dtype, contiguous [T, H]) -> [P, H]: one memcpy per row, spread over the
// threads (at::index_select gathered a 2k-token prefill's 16k pairs at ~2 GB/s, on one thread).
at::Tensor gather_rows(const at::Tensor& x, const std::vector<int64_t>& rows, int64_t threads) {
  const int64_t P = rows.size(), bytes = x.size(1) * x.element_size();
  at::Tensor out = at::empty({P, x.size(1)}, x.options());
  const char* src = static_cast<const char*>(x.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  constexpr int64_t kRowsPerTask = 256;
  parallel_tasks((P + kRowsPerTask - 1) / kRowsPerTask, [&](int64_t task) {
    const int64_t end = std::min(P, (task + 1) * kRowsPerTask);
    for (int64_t p = task * kRowsPerTask; p < end; ++p)
      std::memcpy(dst + p * bytes, src + rows[p] * bytes, bytes);
  }, P >= 2 * kRowsPerTask ? threads : 1);
  return out;
}

// The router's choice per token: softmax over the experts' logits (fp32), the top k (largest
// first, the lower expert id on a tie), optionally renormalised to sum to 1; each chosen expert
// adds 1 to counts[e] when `counts` is not empty (the per-expert load metrics).
std::tuple<at::Tensor, at::Tensor> moe_topk(const at::Tensor& logits_in, int64_t k,
                                            bool renormalize, at::Tensor& counts) {
  TORCH_CHECK(logits_in.dim() == 2 && k >= 1 && k <= logits_in.size(1),
              "moe_topk: logits must be [T, E] with 1 <= k <= E");
  at::Tensor logits = logits_in.to(at::kFloat).contiguous();
  const int64_t T = logits.size(0), E = logits.size(1);
  TORCH_CHECK(counts.numel() == 0 || (counts.scalar_type() == at::kLong && counts.numel() == E &&
                                      counts.is_contiguous()),
              "moe_topk: counts must be empty or int64 [E]");
  at::Tensor weights = at::empty({T, k}, logits.options());
  at::Tensor ids = at::empty({T, k}, logits.options().dtype(at::kLong));
  const float* lp = logits.data_ptr<float>();
  float* wp = weights.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  std::vector<int64_t> order(E);
  std::vector<float> prob(E);
  for (int64_t t = 0; t < T; ++t) {
    const float* l = lp + t * E;
    const float mx = *std::max_element(l, l + E);
    float sum = 0;
    for (int64_t e = 0; e < E; ++e) sum += (prob[e] = std::exp(l[e] - mx));
    for (int64_t e = 0; e < E; ++e) order[e] = e;
    std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int64_t a, int64_t b) {
      return prob[a] > prob[b] || (prob[a] == prob[b] && a < b);
    });
    float top = 0;
    for (int64_t j = 0; j < k; ++j) top += prob[order[j]] / sum;
    for (int64_t j = 0; j < k; ++j) {
      const float w = prob[order[j]] / sum;
      wp[t * k + j] = renormalize ? w / top : w;
      ip[t * k + j] = order[j];
    }
  }
  if (counts.numel()) {
    int64_t* cp = counts.data_ptr<int64_t>();
    for (int64_t p = 0; p < T * k; ++p) ++cp[ip[p]];
  }
  return {weights, ids};
}

// The shared expert folded into moe_experts' quantized path (mla_decode_layers): its packed
// [gate | up] and down rows, the same shapes and formats as one routed expert's.
struct SharedExpert {
  QWeight w13, w2;
};

// What a family's experts add to `down(silu(gate) * up)` (gpt-oss): a bias per expert on its
// [gate | up] rows and on its down rows (undefined tensors: none), and the activation between.
enum ExpertActivation : int64_t { kSiluMul = 0, kClampedSwiglu = 1 };
struct ExpertExtras {
  at::Tensor b13, b2;  // [E, 2I], [E, H] (any float dtype; converted as each path needs)
  int64_t activation = kSiluMul;
  double alpha = 1.702, limit = 7.0;  // kClampedSwiglu's (transformers' GptOssExperts)
  at::Tensor act(const at::Tensor& gu) const {
    return activation == kClampedSwiglu ? clamped_swiglu(gu, alpha, limit) : silu_mul(gu);
  }
};

// rows [offset[e], offset[e + 1]) of `rows` [P, width] += bias[e] (float32 [E, width]): each
// active expert's bias over its pairs' rows, one task per expert.
void add_expert_bias(float* rows, int64_t width, const ExpertPairs& s, const at::Tensor& bias,
                     int64_t threads) {
  const float* b = bias.data_ptr<float>();
  const int64_t E = s.offset.size() - 1;
  parallel_tasks(E, [&](int64_t e) {
    const float* be = b + e * width;
    for (int64_t p = s.offset[e]; p < s.offset[e + 1]; ++p) {
      float* r = rows + p * width;
#pragma omp simd
      for (int64_t j = 0; j < width; ++j) r[j] += be[j];
    }
  }, s.offset[E] >= 16 ? threads : 1);
}

at::Tensor moe_experts_impl(const at::Tensor& x_in, const at::Tensor& w13, const at::Tensor& w2,
                            const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                            int64_t expert_start, std::vector<at::Tensor> q,
                            std::vector<int64_t> qtypes, int64_t threads, bool int8_act,
                            const SharedExpert* shared, const ExpertExtras& extras = {}) {
  TORCH_CHECK(x_in.dim() == 2, "moe_experts: x must be [T, H]");
  TORCH_CHECK(w13.dim() == 3 && w2.dim() == 3 && w13.size(0) == w2.size(0) &&
                  w13.size(2) == x_in.size(1) && w2.size(1) == x_in.size(1) &&
                  w13.size(1) == 2 * w2.size(2),
              "moe_experts: w13 must be [E, 2I, H] and w2 [E, H, I] for x [T, H]");
  TORCH_CHECK(topk_ids.scalar_type() == at::kLong && topk_weights.sizes() == topk_ids.sizes() &&
                  topk_ids.dim() == 2 && topk_ids.size(0) == x_in.size(0),
              "moe_experts: topk_ids (int64) and topk_weights must both be [T, k]");
  TORCH_CHECK(q.empty() || (q.size() == 6 && qtypes.size() == 2),
              "moe_experts: quantized weights are [qs13, d13, m13, qs2, d2, m2] with 2 types");
  const int64_t T = x_in.size(0), H = x_in.size(1), k = topk_ids.size(1);
  const int64_t E = w13.size(0), I = w2.size(2);
  at::Tensor ids = topk_ids.contiguous();
  at::Tensor tw = topk_weights.to(at::kFloat).contiguous();
  const ExpertPairs s = sort_pairs(ids.data_ptr<int64_t>(), T, k, E, expert_start);
  const int64_t P = s.offset[E];
  TORCH_CHECK(!shared || !q.empty(), "moe_experts: a folded shared expert needs packed experts");
  TORCH_CHECK(!extras.b13.defined() || extras.b13.sizes() == at::IntArrayRef({E, 2 * I}),
              "moe_experts: b13 must be [E, 2I]");
  TORCH_CHECK(!extras.b2.defined() || extras.b2.sizes() == at::IntArrayRef({E, H}),
              "moe_experts: b2 must be [E, H]");
  TORCH_CHECK(extras.activation == kSiluMul || extras.activation == kClampedSwiglu,
              "moe_experts: activation must be 0 (silu_mul) or 1 (clamped SwiGLU)");
  TORCH_CHECK(!shared || (!extras.b13.defined() && !extras.b2.defined() &&
                          extras.activation == kSiluMul),
              "moe_experts: a folded shared expert takes no biases or other activation");
  // With the shared expert: rows [P, P + T) of xs, gu, act and ys are every token's own
  const int64_t S = shared ? T : 0;
  at::Tensor out = at::zeros({T, H}, x_in.options().dtype(at::kFloat));
  if (P + S == 0) return out;
  at::Tensor ys;
  if (!q.empty()) {
    TORCH_CHECK(x_in.scalar_type() == at::kFloat, "moe_experts: quantized experts take float32 x");
    const QWeight q13 =
        packed_weight(q[0], q[1], q[2], qtypes[0], E * 2 * I, H, "moe_experts: w13");
    const QWeight q2 = packed_weight(q[3], q[4], q[5], qtypes[1], E * H, I, "moe_experts: w2");
    TORCH_CHECK(!int8_act || kquant_superblock_act() || (q13.qtype != kQ6_K && q2.qtype != kQ6_K),
                "moe_experts: Q6_K experts take float32 activations (no int8_act)");
    std::vector<int64_t> rows = s.token;
    for (int64_t t = 0; t < S; ++t) rows.push_back(t);
    at::Tensor xs = gather_rows(x_in.contiguous(), rows, threads);  // [P + S, H]
    at::Tensor gu = at::empty({P + S, 2 * I}, xs.options());
    thread_local std::vector<int8_t> qx;
    thread_local std::vector<float> sc;
    thread_local std::vector<int16_t> X;
    int64_t dxe_row = 0;
    QAct a13{}, a2{};
    if (int8_act)
      a13 = quantize_expert_rows(xs.data_ptr<float>(), P + S, H, q13.qtype, s, qx, sc, X,
                                 dxe_row, threads);
    experts_qlinear(q13, 2 * I, s, xs.data_ptr<float>(), gu.data_ptr<float>(), threads,
                    int8_act ? &a13 : nullptr, dxe_row, shared ? &shared->w13 : nullptr, S,
                    X.data());
    if (extras.b13.defined())
      add_expert_bias(gu.data_ptr<float>(), 2 * I, s, extras.b13.to(at::kFloat).contiguous(),
                      threads);
    at::Tensor act = extras.act(gu);  // [P + S, I]
    ys = at::empty({P + S, H}, xs.options());
    if (int8_act)
      a2 = quantize_expert_rows(act.data_ptr<float>(), P + S, I, q2.qtype, s, qx, sc, X, dxe_row,
                                threads);
    experts_qlinear(q2, H, s, act.data_ptr<float>(), ys.data_ptr<float>(), threads,
                    int8_act ? &a2 : nullptr, dxe_row, shared ? &shared->w2 : nullptr, S,
                    X.data());
    if (extras.b2.defined())
      add_expert_bias(ys.data_ptr<float>(), H, s, extras.b2.to(at::kFloat).contiguous(), threads);
  } else {
    TORCH_CHECK(w13.scalar_type() == w2.scalar_type(), "moe_experts: w13 and w2 dtypes differ");
    at::Tensor xs = gather_rows(x_in.to(w13.scalar_type()).contiguous(), s.token, threads);
    ys = at::empty({P, H}, xs.options());
    // biases as F.linear takes them: in the weights' dtype, one addmm per projection
    const at::Tensor b13 = extras.b13.defined() ? extras.b13.to(w13.scalar_type()) : at::Tensor();
    const at::Tensor b2 = extras.b2.defined() ? extras.b2.to(w13.scalar_type()) : at::Tensor();
    for (int64_t e = 0; e < E; ++e) {
      const int64_t p0 = s.offset[e], n = s.offset[e + 1] - p0;
      if (n == 0) continue;
      const at::Tensor xe = xs.narrow(0, p0, n);
      at::Tensor gu = b13.defined() ? at::addmm(b13[e], xe, w13[e].t()) : at::mm(xe, w13[e].t());
      at::Tensor y = ys.narrow(0, p0, n);
      if (b2.defined())
        at::addmm_out(y, b2[e], extras.act(gu), w2[e].t());
      else
        at::mm_out(y, extras.act(gu), w2[e].t());
    }
    ys = ys.to(at::kFloat);
  }
  const float* yp = ys.data_ptr<float>();
  const float* wp = tw.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t* pos = s.pos.data();
  parallel_tasks(T, [&](int64_t t) {
    float* o = op + t * H;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t p = pos[t * k + j];
      if (p < 0) continue;
      const float w = wp[t * k + j];
      const float* y = yp + p * H;
#pragma omp simd
      for (int64_t h = 0; h < H; ++h) o[h] += w * y[h];
    }
    if (S) {  // after the routed sum, as the separate shared MLP's output was added
      const float* y = yp + (P + t) * H;
#pragma omp simd
      for (int64_t h = 0; h < H; ++h) o[h] += y[h];
    }
  }, T >= 4 ? threads : 1);
  return out;
}

at::Tensor moe_experts(const at::Tensor& x_in, const at::Tensor& w13, const at::Tensor& w2,
                       const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                       int64_t expert_start, std::vector<at::Tensor> q, std::vector<int64_t> qtypes,
                       int64_t threads, bool int8_act, const std::optional<at::Tensor>& b13,
                       const std::optional<at::Tensor>& b2, int64_t activation, double alpha,
                       double limit) {
  ExpertExtras extras;
  if (b13) extras.b13 = *b13;
  if (b2) extras.b2 = *b2;
  extras.activation = activation;
  extras.alpha = alpha;
  extras.limit = limit;
  return moe_experts_impl(x_in, w13, w2, topk_weights, topk_ids, expert_start, std::move(q),
                          std::move(qtypes), threads, int8_act, nullptr, extras);
}
