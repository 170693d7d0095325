// The qlinear op: float32 activations (qlinear.h) or 8-bit ones (qlinear_a8.h's tiles, and
// kquant_gemm.h's GEMMs for prompt steps of many rows).
//
// A fragment of hearth's one kernel build: included by cpu_kernels.cpp inside
// namespace hearth::(anonymous), after qlinear.h, qlinear_a8.h and kquant_gemm.h.

// Steps of at least this many rows take qlinear_q4k_gemm / qlinear_q6k_gemm (where the build
// has them).
constexpr int64_t kKQuantGemmMinRows = 8;

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
  if (int8_act && (qtype == kQ4_K || qtype == kQ6_K) && kKQuantGemm && M >= kKQuantGemmMinRows) {
    const bool q4k = qtype == kQ4_K;
    thread_local std::vector<int8_t> qx;
    thread_local std::vector<float> sc;
    thread_local std::vector<int16_t> X;
    sc.resize(M * nb * 2 + M * (nb + 1) / 2 * 16);
    qx.resize(M * in_features);
    float* dx = sc.data();
    quantize_rows(xp, M, in_features, q4k ? kQ4KPanel : kQ6KPanel, qx.data(), dx, dx + M * nb,
                  dx + 2 * M * nb, kQK_K);
    const QAct a{M, nb, in_features, qx.data(), dx, dx + M * nb, dx + 2 * M * nb};
    if (!q4k) {
      X.resize(M * nb * 2);  // 16 per super-block
      q6k_group_sums(a, nb / 8, X.data());
    }
    const int16_t* xg = X.data();  // this thread's buffer (thread_local), read by every thread
    constexpr int64_t kTaskRows = 64;
    parallel_tasks((N + kTaskRows - 1) / kTaskRows, [&](int64_t task) {
      const int64_t n0 = task * kTaskRows, n1 = std::min(N, n0 + kTaskRows);
      if (q4k) qlinear_q4k_gemm(w, n0, n1, a, op);
      else qlinear_q6k_gemm(w, n0, n1, a, xg, op);
    }, threads);
    return out.view(out_shape);
  }
  if (int8_act && (qtype != kQ6_K || kquant_superblock_act())) {  // else Q6_K: float32 (qlinear.h)
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
