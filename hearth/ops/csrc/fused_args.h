// The argument structs of the fused decode ops (decode_layers, mla_decode_layers).
//
// A fragment of hearth's one kernel build: included by cpu_kernels.cpp inside
// namespace hearth::(anonymous), after qlinear.h and before decode_layers.h.
//
// A torch op's schema takes tensors, lists and scalars only, so each model's weights cross the
// boundary as one tensor list, one ggml-type list and one int and one float list per call. Each
// list has one layout, written once below as an X-macro that names every field: the structs are
// unpacked from it here, and hearth/ops/fused_decode.py packs its dataclasses of the same names
// in the same order (its unit test compares both against `fused_decode_layout`).
//
//   T(name): a tensor (empty: absent)        P(name): a packed weight, 3 tensors [qs, d, m] and
//   I(name): an int64 of `dims`                       one entry of the types list
//   F(name): a double of `fdims`

// decode_layers, per layer: the input and post-attention norms, the four packed linears.
#define HEARTH_LLAMA_LAYER(T, P) T(in_norm) T(post_norm) P(qkv) P(o) P(gate_up) P(down)
#define HEARTH_LLAMA_SHAPE(I, F) \
  I(num_heads) I(num_kv_heads) I(head_dim) I(intermediate) F(scale) F(eps)

// mla_decode_layers, per layer: the norms; q (q_b_proj, or q_proj without a q bottleneck) and
// the q / kv bottleneck norms; kv_b_proj's float32 weight [H (nope + v), L] (W_UK and W_UV,
// absorbed); the dense MLP or the shared experts; the router [E, hidden] float32 and its
// correction bias [E] (absent: a dense layer); the experts' stacked float weights (shapes
// only) and their packed rows; the absorbed up-projections packed (W_UK_h^T [H L, nope] and
// W_UV_h [H v, L], heads_qlinear; absent: kv_b's float rows serve).
#define HEARTH_MLA_LAYER(T, P)                                                              \
  T(in_norm) T(post_norm) P(qkv_a) T(q_a_norm) P(q) T(kv_a_norm) T(kv_b) P(o) P(gate_up)    \
  P(down) T(router) T(router_bias) T(w13) T(w2) P(q13) P(q2) P(uk) P(uv)
// scoring: 0 softmax, 1 sigmoid; topk_method: 0 greedy, 1 group_limited_greedy, 2 noaux_tc;
// q_lora_rank 0: no q bottleneck; dense_width / shared_width: the dense MLP's / the shared
// experts' intermediate width.
#define HEARTH_MLA_SHAPE(I, F)                                                              \
  I(num_heads) I(qk_nope) I(qk_rope) I(v_head) I(kv_lora_rank) I(q_lora_rank) I(top_k)     \
  I(n_group) I(topk_group) I(scoring) I(topk_method) I(renormalize) I(expert_start)        \
  I(dense_width) I(shared_width) F(eps) F(scale) F(routed_scaling_factor)

#define HEARTH_FIELD_TENSOR(name) at::Tensor name;
#define HEARTH_FIELD_PACKED(name) Packed name;
#define HEARTH_FIELD_INT(name) int64_t name = 0;
#define HEARTH_FIELD_FLOAT(name) double name = 0;
#define HEARTH_READ_TENSOR(name) out.name = r.tensor();
#define HEARTH_READ_PACKED(name) out.name = r.packed();
#define HEARTH_READ_INT(name) out.name = dims[i++];
#define HEARTH_READ_FLOAT(name) out.name = fdims[f++];
#define HEARTH_COUNT_TENSOR(name) +1
#define HEARTH_COUNT_PACKED(name) +3
#define HEARTH_COUNT_ONE(name) +1
#define HEARTH_COUNT_NONE(name)
#define HEARTH_NAME(name) #name,

// A packed weight as the fused ops take it (hearth.ops.cpu_kernels.PackedWeight).
struct Packed {
  at::Tensor qs, d, m;
  int64_t qtype = 0;
  bool present() const { return qs.defined() && qs.numel() > 0; }
};

// Walks one layer's slice of the tensor and type lists in layout order.
struct LayerReader {
  at::TensorList w;
  at::IntArrayRef types;
  int64_t t = 0, p = 0;
  at::Tensor tensor() { return w[t++]; }
  Packed packed() {
    Packed out{w[t], w[t + 1], w[t + 2], types[p++]};
    t += 3;
    return out;
  }
};

// How a fused call runs: context tokens per attention work item, threads, 8-bit activations.
struct KernelRun {
  int64_t split, threads;
  bool int8_act;
};

// The step's short queries (AttentionMetadata's short_* fields; fused_decode.ShortQueryStep).
struct ShortQueries {
  at::Tensor positions, slot_mapping, block_tables, context_lens;
  std::optional<at::Tensor> query_lens;
};

struct LlamaLayer {
  HEARTH_LLAMA_LAYER(HEARTH_FIELD_TENSOR, HEARTH_FIELD_PACKED)
  static constexpr int64_t kTensors = 0 HEARTH_LLAMA_LAYER(HEARTH_COUNT_TENSOR, HEARTH_COUNT_PACKED);
  static constexpr int64_t kTypes = 0 HEARTH_LLAMA_LAYER(HEARTH_COUNT_NONE, HEARTH_COUNT_ONE);
  static LlamaLayer read(at::TensorList w, at::IntArrayRef types, int64_t l) {
    LlamaLayer out;
    LayerReader r{w.slice(kTensors * l, kTensors), types.slice(kTypes * l, kTypes)};
    HEARTH_LLAMA_LAYER(HEARTH_READ_TENSOR, HEARTH_READ_PACKED)
    return out;
  }
};

struct LlamaShape {
  HEARTH_LLAMA_SHAPE(HEARTH_FIELD_INT, HEARTH_FIELD_FLOAT)
  static constexpr int64_t kInts = 0 HEARTH_LLAMA_SHAPE(HEARTH_COUNT_ONE, HEARTH_COUNT_NONE);
  static constexpr int64_t kFloats = 0 HEARTH_LLAMA_SHAPE(HEARTH_COUNT_NONE, HEARTH_COUNT_ONE);
  static LlamaShape read(at::IntArrayRef dims, at::ArrayRef<double> fdims) {
    TORCH_CHECK(static_cast<int64_t>(dims.size()) == kInts &&
                    static_cast<int64_t>(fdims.size()) == kFloats,
                "decode_layers: ", kInts, " dims and ", kFloats, " float dims");
    LlamaShape out;
    size_t i = 0, f = 0;
    HEARTH_LLAMA_SHAPE(HEARTH_READ_INT, HEARTH_READ_FLOAT)
    return out;
  }
};

struct MlaLayer {
  HEARTH_MLA_LAYER(HEARTH_FIELD_TENSOR, HEARTH_FIELD_PACKED)
  static constexpr int64_t kTensors = 0 HEARTH_MLA_LAYER(HEARTH_COUNT_TENSOR, HEARTH_COUNT_PACKED);
  static constexpr int64_t kTypes = 0 HEARTH_MLA_LAYER(HEARTH_COUNT_NONE, HEARTH_COUNT_ONE);
  static MlaLayer read(at::TensorList w, at::IntArrayRef types, int64_t l) {
    MlaLayer out;
    LayerReader r{w.slice(kTensors * l, kTensors), types.slice(kTypes * l, kTypes)};
    HEARTH_MLA_LAYER(HEARTH_READ_TENSOR, HEARTH_READ_PACKED)
    return out;
  }
  bool moe() const { return router.numel() > 0; }
};

struct MlaShape {
  HEARTH_MLA_SHAPE(HEARTH_FIELD_INT, HEARTH_FIELD_FLOAT)
  static constexpr int64_t kInts = 0 HEARTH_MLA_SHAPE(HEARTH_COUNT_ONE, HEARTH_COUNT_NONE);
  static constexpr int64_t kFloats = 0 HEARTH_MLA_SHAPE(HEARTH_COUNT_NONE, HEARTH_COUNT_ONE);
  static MlaShape read(at::IntArrayRef dims, at::ArrayRef<double> fdims) {
    TORCH_CHECK(static_cast<int64_t>(dims.size()) == kInts &&
                    static_cast<int64_t>(fdims.size()) == kFloats,
                "mla_decode_layers: ", kInts, " dims and ", kFloats, " float dims");
    MlaShape out;
    size_t i = 0, f = 0;
    HEARTH_MLA_SHAPE(HEARTH_READ_INT, HEARTH_READ_FLOAT)
    return out;
  }
};

// The field names of one layout, in order: what fused_decode.py's dataclasses must match.
std::vector<std::string> fused_decode_layout(const std::string& name) {
  if (name == "llama_layer") return {HEARTH_LLAMA_LAYER(HEARTH_NAME, HEARTH_NAME)};
  if (name == "llama_shape") return {HEARTH_LLAMA_SHAPE(HEARTH_NAME, HEARTH_NAME)};
  if (name == "mla_layer") return {HEARTH_MLA_LAYER(HEARTH_NAME, HEARTH_NAME)};
  if (name == "mla_shape") return {HEARTH_MLA_SHAPE(HEARTH_NAME, HEARTH_NAME)};
  TORCH_CHECK(false, "fused_decode_layout: no layout ", name);
  return {};
}

// y = x W^T through one packed weight of `out_features` rows (qlinear with a Packed).
inline at::Tensor linear(const at::Tensor& x, const Packed& w, int64_t out_features,
                         const KernelRun& run) {
  return qlinear(x, w.qs, w.d, w.m, w.qtype, out_features, x.size(1), run.threads, run.int8_act);
}
