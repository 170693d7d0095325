// Elementwise fusions: RMS norms, SiLU-mul, RoPE + KV-cache writes, q/k norms.
//
// A fragment of hearth's one kernel build: included by cpu_kernels.cpp inside
// namespace hearth::(anonymous), after the headers listed before it there.

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

// [T, 2I] (gate | up) -> [T, I] in gate_up's dtype: out[t, j] = f(gate[t, j], up[t, j]).
template <typename F>
at::Tensor gated_rows(const at::Tensor& gate_up_in, const char* name, F f) {
  at::Tensor gu = gate_up_in.contiguous();
  check_act(gu, name);
  const int64_t T = gu.size(0), I = gu.size(1) / 2;
  at::Tensor out = at::empty({T, I}, gu.options());
  dispatch_act(gu, out, [&](auto* gp, auto* op) {
    at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const auto* g = gp + t * 2 * I;
        const auto* u = g + I;
        auto* o = op + t * I;
#pragma omp simd
        for (int64_t j = 0; j < I; ++j) act_store(o, j, f(act_load(g, j), act_load(u, j)));
      }
    });
  });
  return out;
}

// silu(gate) * up.
at::Tensor silu_mul(const at::Tensor& gate_up_in) {
  return gated_rows(gate_up_in, "silu_mul",
                    [](float g, float u) { return g / (1.0f + fast_exp(-g)) * u; });
}

// gpt-oss's clamped SwiGLU (transformers' GptOssExperts): g = min(gate, limit),
// u = clamp(up, -limit, limit), (u + 1) g sigmoid(alpha g).
at::Tensor clamped_swiglu(const at::Tensor& gate_up_in, double alpha, double limit) {
  const float a = static_cast<float>(alpha), l = static_cast<float>(limit);
  return gated_rows(gate_up_in, "clamped_swiglu", [a, l](float gate, float up) {
    const float g = std::min(gate, l), u = std::min(std::max(up, -l), l);
    return (u + 1.0f) * (g / (1.0f + fast_exp(-a * g)));
  });
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
