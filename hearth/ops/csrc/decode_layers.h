// Whole Llama decoder layers for steps of short queries (decode_layers), and the ggml
// repacking of weights for qlinear (repack_ggml).
//
// A fragment of hearth's one kernel build: included by cpu_kernels.cpp inside
// namespace hearth::(anonymous), after the headers listed before it there.

// One whole Llama decoder layer for a step of short queries: the same ops as the module path,
// in the same order; `residual` is updated in place (and is `x` itself for the first layer).
std::tuple<at::Tensor, at::Tensor> decode_layer(const at::Tensor& x,
                                                const at::Tensor& residual_in, bool has_residual,
                                                const LlamaLayer& w, const LlamaShape& shape,
                                                const at::Tensor& cos, const at::Tensor& sin,
                                                at::Tensor k_cache, at::Tensor v_cache,
                                                const ShortQueries& step, const KernelRun& run) {
  const int64_t T = x.size(0), hidden = x.size(1);
  const int64_t H = shape.num_heads, KVH = shape.num_kv_heads, D = shape.head_dim;
  const int64_t q_size = H * D, kv_size = KVH * D;
  at::Tensor residual = has_residual ? residual_in : x;
  at::Tensor normed = has_residual ? add_rms_norm(x, residual, w.in_norm, shape.eps)
                                   : rms_norm(x, w.in_norm, shape.eps);
  at::Tensor qkv = linear(normed, w.qkv, q_size + 2 * kv_size, run);
  rope_write_kv(qkv, step.positions, cos, sin, k_cache, v_cache, step.slot_mapping, H, KVH, D);
  at::Tensor q = qkv.narrow(1, 0, q_size).reshape({T, H, D});
  at::Tensor attn = decode_attention(q, k_cache, v_cache, step.block_tables, step.context_lens,
                                     shape.scale, run.split, run.threads, step.query_lens);
  at::Tensor h = linear(attn.view({T, q_size}), w.o, hidden, run);
  at::Tensor normed2 = add_rms_norm(h, residual, w.post_norm, shape.eps);
  at::Tensor gate_up = linear(normed2, w.gate_up, 2 * shape.intermediate, run);
  at::Tensor out = linear(silu_mul(gate_up), w.down, hidden, run);
  return {out, residual};
}

// Layers [0, L) of a Llama model for a step of short queries only, one decode_layer after
// another in one call: a batch-1 decode step made 30 Python calls of 25 arguments each (~1 ms
// of an 11 ms step on this machine); now it makes one. `weights` / `qtypes`: each layer's
// LlamaLayer (fused_args.h) in turn; `dims` / `fdims`: one LlamaShape; k_caches[l],
// v_caches[l]: layer l's cache. Returns (hidden, residual) after the last layer.
std::tuple<at::Tensor, at::Tensor> decode_layers(
    const at::Tensor& x, const at::Tensor& residual_in, bool has_residual, at::TensorList weights,
    at::IntArrayRef qtypes, at::IntArrayRef dims, at::ArrayRef<double> fdims,
    const at::Tensor& rope_cos, const at::Tensor& rope_sin, at::TensorList k_caches,
    at::TensorList v_caches, const at::Tensor& positions, const at::Tensor& slot_mapping,
    const at::Tensor& block_tables, const at::Tensor& context_lens,
    const std::optional<at::Tensor>& query_lens, int64_t split, int64_t threads, bool int8_act) {
  const int64_t L = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(L >= 1 && static_cast<int64_t>(v_caches.size()) == L &&
                  static_cast<int64_t>(weights.size()) == LlamaLayer::kTensors * L &&
                  static_cast<int64_t>(qtypes.size()) == LlamaLayer::kTypes * L,
              "decode_layers: per layer ", LlamaLayer::kTensors, " weight tensors, ",
              LlamaLayer::kTypes, " types and a K and V cache");
  const LlamaShape shape = LlamaShape::read(dims, fdims);
  const ShortQueries step{positions, slot_mapping, block_tables, context_lens, query_lens};
  const KernelRun run{split, threads, int8_act};
  at::Tensor hidden = x, residual = residual_in;
  bool has = has_residual;
  for (int64_t l = 0; l < L; ++l) {
    std::tie(hidden, residual) =
        decode_layer(hidden, residual, has, LlamaLayer::read(weights, qtypes, l), shape,
                     rope_cos, rope_sin, k_caches[l], v_caches[l], step, run);
    has = true;
  }
  return {hidden, residual};
}

// One row of Q4_K super-blocks (144 bytes each: d fp16 | dmin fp16 | 12 bytes of 6-bit scales
// and mins | 128 bytes of nibbles) -> qlinear's Q4_K layout (qlinear.h): (d, dmin) pairs, each
// super-block's 8 scales then 8 mins as bytes, and the nibbles in Q4_1's order. A super-block's byte 32j + i
// holds element i of block 2j (low nibble) and of block 2j + 1 (high nibble); qlinear's block
// byte i holds elements i (low) and i + 16 (high).
//   scales bytes 0-3: EEaaaaaa (a: scale j = 0..3, E: high 2 bits of scale j + 4)
//          bytes 4-7: FFbbbbbb (b: min j = 0..3,   F: high 2 bits of min j + 4)
//          bytes 8-11: ffffeeee (e: low 4 bits of scale j + 4, f: low 4 bits of min j + 4)
inline void repack_q4_k_row(const uint8_t* row, int64_t num_super, uint8_t* qs, uint16_t* d,
                            uint8_t* ks) {
  for (int64_t s = 0; s < num_super; ++s) {
    const uint8_t* blk = row + s * 144;
    std::memcpy(d + 2 * s, blk, 4);  // d, dmin
    const uint8_t* p = blk + 4;
    uint8_t* k = ks + s * 16;
    for (int j = 0; j < 4; ++j) {  // scales in k[0..7], mins in k[8..15]
      k[j] = p[j] & 63;
      k[8 + j] = p[j + 4] & 63;
      k[j + 4] = (p[j + 8] & 0x0F) | ((p[j] >> 6) << 4);
      k[8 + j + 4] = (p[j + 8] >> 4) | ((p[j + 4] >> 6) << 4);
    }
    const uint8_t* q = blk + 16;
    uint8_t* out = qs + s * 128;
    for (int j = 0; j < 4; ++j)
      for (int i = 0; i < 16; ++i) {
        const uint8_t a = q[32 * j + i], b = q[32 * j + i + 16];
        out[32 * j + i] = static_cast<uint8_t>((a & 0x0F) | (b << 4));
        out[32 * j + 16 + i] = static_cast<uint8_t>((a >> 4) | (b & 0xF0));
      }
  }
}

// One row of Q6_K super-blocks (210 bytes each: ql 128 | qh 64 | 16 int8 scales | d fp16) ->
// qlinear's Q6_K layout (qlinear.h): the 256 values q - 32 as int8 in order, the 16 scales, d.
// Each 128-element half h reads ql[64 h ..] and qh[32 h ..]; its element 32 s + i (s = 0..3) is
// ql[64 h + 32 (s % 2) + i]'s low (s < 2) or high nibble, with bits 2 s, 2 s + 1 of
// qh[32 h + i] above them.
inline void repack_q6_k_row(const uint8_t* row, int64_t num_super, uint8_t* qs, uint16_t* d,
                            uint8_t* ks) {
  for (int64_t s = 0; s < num_super; ++s) {
    const uint8_t* blk = row + s * 210;
    std::memcpy(d + s, blk + 208, 2);
    std::memcpy(ks + s * 16, blk + 192, 16);
    int8_t* out = reinterpret_cast<int8_t*>(qs + s * 256);
    for (int h = 0; h < 2; ++h)
      for (int part = 0; part < 4; ++part)
        for (int i = 0; i < 32; ++i) {
          const uint8_t l = blk[64 * h + 32 * (part % 2) + i];
          const uint8_t low = part < 2 ? (l & 0x0F) : (l >> 4);
          const uint8_t high = (blk[128 + 32 * h + i] >> (2 * part)) & 0x03;
          out[128 * h + 32 * part + i] = static_cast<int8_t>((low | (high << 4)) - 32);
        }
  }
}

// ggml blocks -> the layout qlinear reads (hearth.ops.cpu_kernels.pack_ggml): each block's fp16
// scale (and Q4_1 offset) moved to its own array, its quants kept in row order. The output rows
// interleave the parts by group: for each of `groups` groups, rows_per_group[p] rows of each
// part p in turn (one group: QKV stacked; groups = experts: each expert's [gate | up]).
// A plain copy, but torch's strided copy of 32-byte runs took ~2 s for a 1 GB MoE model.
std::vector<at::Tensor> repack_ggml(const std::vector<at::Tensor>& parts,
                                    const std::vector<int64_t>& rows_per_group, int64_t groups,
                                    int64_t qtype, int64_t threads) {
  TORCH_CHECK(qtype == kQ4_0 || qtype == kQ4_1 || qtype == kQ8_0 || qtype == kQ4_K ||
                  qtype == kQ6_K,
              "repack_ggml: ggml type ", qtype);
  TORCH_CHECK(!parts.empty() && parts.size() == rows_per_group.size() && groups >= 1,
              "repack_ggml: one rows_per_group entry per part");
  const bool k4 = qtype == kQ4_K, k6 = qtype == kQ6_K;  // super-blocks of 8 blocks
  const int64_t bbytes = k4 ? 144 : k6 ? 210 : qtype == kQ8_0 ? 34 : qtype == kQ4_1 ? 20 : 18;
  const int64_t head = qtype == kQ4_1 ? 4 : 2, qbytes = k4 ? 16 : k6 ? 32 : bbytes - head;
  const int64_t row_bytes = parts[0].size(-1), nb = row_bytes / bbytes * (k4 || k6 ? 8 : 1);
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
  at::Tensor d = at::empty({N, k4 ? nb / 4 : k6 ? nb / 8 : nb}, u8.dtype(at::kHalf));
  at::Tensor m = qtype == kQ4_1 ? at::empty({N, nb}, u8.dtype(at::kHalf))
                 : k4 || k6    ? at::empty({N, nb * 2}, u8)
                               : at::empty({0}, u8.dtype(at::kHalf));
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
      if (k4) {
        repack_q4_k_row(row, nb / 8, qp + o * nb * 16, dp + o * (nb / 4), m.data_ptr<uint8_t>() + o * nb * 2);
        continue;
      }
      if (k6) {
        repack_q6_k_row(row, nb / 8, qp + o * nb * 32, dp + o * (nb / 8), m.data_ptr<uint8_t>() + o * nb * 2);
        continue;
      }
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
