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
//   decode_layers    whole Llama decoder layers for a step of short queries (decode_layers.h),
//                    their arguments named structs (fused_args.h).
//   moe_experts      a Mixture-of-Experts layer's experts (moe.h): pairs sorted by expert, only
//                    the active experts' weights read, quantized for few-row steps.
//   mla_decode_layers whole DeepSeek-V2/V3 / Kimi K2 decoder layers (MLA + dense or DeepSeek
//                    MoE MLP) for a step of short queries (mla_layers.h).
//
// One family per header, all in this one translation unit (so the build and its ISA probes stay
// one library per ISA): common.h (block constants, conversions, the task pool), qlinear.h
// (float32 activations), qlinear_a8.h (8-bit activations), kquant_gemm.h (the prompt steps'
// K-quant GEMMs), qlinear_op.h (the op over both), elementwise.h, decode_attention.h
// (its per-ISA rows: decode_attention_avx512.h, decode_attention_avx2.h), prefill_attention.h,
// amx_attention.h (AMX build only), fused_args.h, decode_layers.h, moe.h, mla_layers.h;
// the op registration is below.
//
// The same source is compiled several times by hearth/ops/build_kernels.py: AVX-512 + VNNI
// (-mavx512f/bw/vl/dq -mavx512vnni), AVX-512 and AVX2; the loader picks the best build this CPU
// runs (probed in a subprocess, so a CPU that lists a feature it cannot execute falls back
// instead of dying). The weight loops and attention rows have hand-written AVX-512 (and
// qlinear's tiles, both activation kinds, AVX2 as well); everything else is plain loops the
// compiler vectorizes (`#pragma omp simd`) for any target.

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
#include <string>
#include <type_traits>
#include <vector>

namespace hearth {
namespace {

#include "common.h"
#include "qlinear.h"
#include "qlinear_a8.h"
#include "kquant_gemm.h"
#include "qlinear_op.h"
#include "elementwise.h"
#include "decode_attention.h"
#include "prefill_attention.h"
#include "amx_attention.h"
#include "fused_args.h"  // the fused decode ops' argument structs
#include "decode_layers.h"
#include "moe.h"  // moe_experts (Mixture-of-Experts layers), on qlinear's tiles
#include "mla_layers.h"  // mla_decode_layers (DeepSeek-V2/V3, Kimi K2), on all of the above

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
        "Tensor context_lens, float scale, int split, int threads=64, Tensor? query_lens=None, "
        "Tensor? sinks=None, int window=0) -> Tensor",
        &hearth::decode_attention);
  m.def("prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
        "int context_len, float scale, int threads=64) -> Tensor",
        &hearth::prefill_attention);
  m.def("decode_layers(Tensor x, Tensor(a!) residual, bool has_residual, Tensor[] weights, "
        "int[] qtypes, int[] dims, float[] fdims, Tensor rope_cos, Tensor rope_sin, "
        "Tensor(b!)[] k_caches, Tensor(c!)[] v_caches, Tensor positions, Tensor slot_mapping, "
        "Tensor block_tables, Tensor context_lens, Tensor? query_lens, int split, int threads, "
        "bool int8_act) -> (Tensor, Tensor)",
        &hearth::decode_layers);
  m.def("moe_experts(Tensor x, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids, "
        "int expert_start, Tensor[] q, int[] qtypes, int threads=64, bool int8_act=False, "
        "Tensor? b13=None, Tensor? b2=None, int activation=0, float alpha=1.702, "
        "float limit=7.0) -> Tensor",
        &hearth::moe_experts);
  m.def("mla_decode_layers(Tensor x, Tensor(a!) residual, bool has_residual, Tensor[] weights, "
        "int[] qtypes, int[] dims, float[] fdims, Tensor(b!)[] expert_counts, Tensor rope_cos, "
        "Tensor rope_sin, Tensor(c!)[] caches, Tensor positions, Tensor slot_mapping, "
        "Tensor block_tables, Tensor context_lens, Tensor? query_lens, int split, int threads, "
        "bool int8_act) -> (Tensor, Tensor)",
        &hearth::mla_decode_layers);
  m.def("fused_decode_layout(str name) -> str[]", &hearth::fused_decode_layout);
  m.def("mla_absorb(Tensor x, Tensor qs, Tensor d, Tensor m, int qtype, int rows, int threads=64, "
        "bool int8_act=False) -> Tensor", &hearth::mla_absorb);
  m.def("moe_topk(Tensor logits, int k, bool renormalize, Tensor(a!) counts) -> (Tensor, Tensor)",
        &hearth::moe_topk);
  m.def("repack_ggml(Tensor[] parts, int[] rows_per_group, int groups, int qtype, int threads=64) "
        "-> Tensor[]", &hearth::repack_ggml);
  m.def("dequant_rows(Tensor qs, Tensor d, Tensor m, int qtype, int out_features, "
        "int in_features, Tensor rows, bool bf16_out=False, int threads=64) -> Tensor",
        &hearth::dequant_rows);
  m.def("requantize_q8_0(Tensor qs, Tensor d, Tensor m, int qtype, int out_features, "
        "int in_features, int threads=64) -> Tensor", &hearth::requantize_q8_0);
  m.def("isa() -> int", &hearth::isa);
  m.def("kquant_superblock_act() -> bool", &hearth::kquant_superblock_act);
  m.def("bf16_dot_products() -> bool", &hearth::bf16_dot_products);
  m.def("amx_attention_usable() -> bool", &hearth::amx_attention_usable);
  m.def("amx_prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
        "int ctx_len, float scale, int threads) -> Tensor", &hearth::amx_prefill_attention);
}
