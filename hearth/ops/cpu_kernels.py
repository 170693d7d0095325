"""hearth's compiled CPU kernels, and the handle the model calls them through.

`load_cpu_kernels()` returns a `CpuKernels` for the best build that passed its probe on this
machine (see hearth/ops/build_kernels.py), or None when none is built or usable: callers then
take the plain-torch path, which computes the same math. Nothing is loaded at import time; the
handle is made once in the executor and handed to the model (no global "current backend").
"""

from __future__ import annotations

import json
import logging
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from hearth.ops import build_kernels

if TYPE_CHECKING:
    from hearth.ops.fused_decode import LlamaStack, MlaStack, ShortQueryStep

log = logging.getLogger("hearth.ops")

# ggml block formats the kernels read directly: type id -> (bytes per block, name). A block is
# 32 elements, a K-quant super-block 256 (Q4_K 144 bytes, Q6_K 210).
QTYPES = {2: (18, "q4_0"), 3: (20, "q4_1"), 8: (34, "q8_0"), 12: (144, "q4_k"), 14: (210, "q6_k"),
          39: (17, "mxfp4")}
Q4_K, Q6_K, MXFP4 = 12, 14, 39
QTYPE_IDS = {name: qtype for qtype, (_, name) in QTYPES.items()}


@dataclass(frozen=True)
class PackedWeight:
    """A `[out_features, in_features]` weight in a ggml block format, repacked for `qlinear`:
    the block bytes with the fp16 scales (and Q4_1 offsets) moved into their own arrays."""

    qtype: int
    # [N, K/2] uint8 nibbles (Q4_0/Q4_1/Q4_K) or [N, K] int8 as uint8 (Q8_0; Q6_K: q - 32)
    qs: torch.Tensor
    # [N, K/32] float16 scales (Q4_K: [N, K/256 * 2], each super-block's d, dmin; Q6_K: its d)
    d: torch.Tensor
    # [N, K/32] float16 offsets (Q4_1); Q4_K: [N, K/256 * 16] uint8 scales then mins per
    # super-block; Q6_K: [N, K/16] int8 scales as uint8; MXFP4: [N, K/32] uint8 exponents
    # (d empty); else empty
    m: torch.Tensor
    out_features: int
    in_features: int
    int8_act: bool = False  # activations quantized to 8 bits per 32-element block (not exact)


def pack_ggml(qtype: int, blocks: torch.Tensor, int8_act: bool = False) -> PackedWeight:
    """`[N, K/32 * block_bytes]` uint8 ggml rows -> PackedWeight (same bytes, rearranged)."""
    if qtype not in QTYPES:
        raise ValueError(f"ggml type {qtype} is not one the CPU kernels read ({QTYPES})")
    if qtype == Q4_K:
        return _pack_q4_k(blocks, int8_act)
    if qtype == Q6_K:
        return _pack_q6_k(blocks, int8_act)
    if qtype == MXFP4:  # ggml's block: the exponent byte, then the nibbles in Q4's order
        b = blocks.reshape(blocks.shape[0], -1, 17)
        return pack_mxfp4(b[:, :, 1:], b[:, :, 0], int8_act)
    bbytes = QTYPES[qtype][0]
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, bbytes)
    nb = b.shape[1]
    head = 4 if qtype == 3 else 2
    d = b[:, :, 0:2].contiguous().view(torch.float16).reshape(n, nb)
    m = (b[:, :, 2:4].contiguous().view(torch.float16).reshape(n, nb) if qtype == 3
         else torch.empty(0, dtype=torch.float16))
    qs = b[:, :, head:].reshape(n, -1).contiguous()
    in_features = nb * 32
    return PackedWeight(qtype, qs, d, m, n, in_features, int8_act)


def _pack_q4_k(blocks: torch.Tensor, int8_act: bool) -> PackedWeight:
    """Q4_K super-blocks -> qlinear's Q4_K layout (csrc/decode_layers.h, repack_q4_k_row):
    (d, dmin) per super-block, its eight 6-bit scales then its eight mins as bytes, nibbles in
    Q4_1's order (byte i: element i low, element i + 16 high)."""
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, 144)
    ns = b.shape[1]
    d = b[:, :, 0:4].contiguous().view(torch.float16).reshape(n, ns * 2)
    p = b[:, :, 4:16].long()
    lo_s, lo_m, mixed = p[..., 0:4], p[..., 4:8], p[..., 8:12]
    scales = torch.cat([lo_s & 63, (mixed & 0x0F) | ((lo_s >> 6) << 4)], -1)  # [n, ns, 8]
    mins = torch.cat([lo_m & 63, (mixed >> 4) | ((lo_m >> 6) << 4)], -1)
    ks = torch.cat([scales, mins], -1).to(torch.uint8).reshape(n, ns * 16)
    q = b[:, :, 16:].reshape(n, ns, 4, 2, 16)  # [.., pair j, first/second 16 bytes, 16]
    a, c = q[:, :, :, 0], q[:, :, :, 1]
    low = (a & 0x0F) | (c << 4)  # block 2j: elements i (low nibble) and i + 16 (high)
    high = (a >> 4) | (c & 0xF0)  # block 2j + 1
    qs = torch.stack([low, high], 3).reshape(n, ns * 128).contiguous()
    return PackedWeight(Q4_K, qs, d, ks, n, ns * 256, int8_act)


def _pack_q6_k(blocks: torch.Tensor, int8_act: bool) -> PackedWeight:
    """Q6_K super-blocks -> qlinear's Q6_K layout (csrc/decode_layers.h, repack_q6_k_row): the
    values q - 32 as int8 in order, the 16 int8 scales, d per super-block."""
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, 210)
    ns = b.shape[1]
    ql = b[:, :, :128].reshape(n, ns, 2, 2, 32)  # [.., half h, 32-byte run, i]
    qh = b[:, :, 128:192].reshape(n, ns, 2, 1, 32)
    low = torch.stack([ql[:, :, :, 0] & 0x0F, ql[:, :, :, 1] & 0x0F,
                       ql[:, :, :, 0] >> 4, ql[:, :, :, 1] >> 4], 3)  # [.., h, part, 32]
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 1, 4, 1)
    high = (qh >> shifts) & 0x03
    q = (low | (high << 4)).to(torch.int16) - 32
    qs = q.to(torch.int8).view(torch.uint8).reshape(n, ns * 256).contiguous()
    d = b[:, :, 208:210].contiguous().view(torch.float16).reshape(n, ns)
    ks = b[:, :, 192:208].reshape(n, ns * 16).contiguous()
    return PackedWeight(Q6_K, qs, d, ks, n, ns * 256, int8_act)


def pack_mxfp4(nibbles: torch.Tensor, exponents: torch.Tensor, int8_act: bool = False,
               interleaved: bool = False) -> PackedWeight:
    """MXFP4 rows: `nibbles` [N, K/32, 16] uint8 and `exponents` [N, K/32] uint8 (block value
    e2m1(q) * 2^(e - 127)) -> the kernels' layout (csrc/qlinear.h): qs [N, K/2] in Q4's nibble
    order, the exponents as m. Nibbles in ggml's order (byte j: elements j low, j + 16 high),
    or with `interleaved` in the OCP / transformers order (byte j: elements 2j low, 2j + 1
    high), which is rearranged (the same bytes' worth: 4.25 bits per weight)."""
    n, groups = exponents.shape
    if (nibbles.dtype != torch.uint8 or exponents.dtype != torch.uint8
            or tuple(nibbles.shape) != (n, groups, 16)):
        raise ValueError(f"MXFP4 blocks {tuple(nibbles.shape)} {nibbles.dtype} and exponents "
                         f"{tuple(exponents.shape)} {exponents.dtype} do not match "
                         f"([N, G, 16] uint8, [N, G] uint8)")
    if interleaved:  # codes [.., 32] in element order, then byte j = code j | code j + 16 << 4
        codes = torch.stack([nibbles & 0x0F, nibbles >> 4], -1).reshape(n, groups, 32)
        nibbles = codes[..., :16] | (codes[..., 16:] << 4)
    return PackedWeight(MXFP4, nibbles.reshape(n, groups * 16).contiguous(),
                        torch.empty(0, dtype=torch.float16), exponents.contiguous(), n,
                        groups * 32, int8_act)


E2M1_X2 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)  # e2m1 values, doubled


def unpack_mxfp4(w: PackedWeight) -> torch.Tensor:
    """An MXFP4 PackedWeight's exact values [N, K] float32 in plain torch (ggml's
    dequantization: e2m1 doubled times 2^(e - 128)), for a device without the kernels."""
    if w.qtype != MXFP4:
        raise ValueError(f"unpack_mxfp4: ggml type {w.qtype} is not MXFP4")
    lut = torch.tensor(E2M1_X2, dtype=torch.float32, device=w.qs.device)
    q = w.qs.view(w.out_features, -1, 16).long()
    values = torch.cat([lut[q & 0x0F], lut[q >> 4]], -1)  # [N, K/32, 32]: j low, j + 16 high
    e = w.m.to(torch.int32)  # 2^(e - 128) as ggml builds it: its float32 bits (e < 2: subnormal)
    scales = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23).view(torch.float32)
    return (values * scales[..., None]).reshape(w.out_features, w.in_features)


def pack_ggml_parts(qtype: int, parts: list[torch.Tensor], rows_per_group: list[int],
                    groups: int = 1, int8_act: bool = False) -> PackedWeight:
    """`pack_ggml` of several block tensors' rows interleaved by group (for each group,
    rows_per_group[p] rows of each part p in turn): QKV or gate/up stacked (one group), or each
    expert's [gate | up] (groups = experts). One pass through the loaded kernels' `repack_ggml`
    (a strided torch copy of the same bytes took ~2 s of a 1 GB MoE model's cold start)."""
    if not hasattr(torch.ops.hearth, "repack_ggml") or qtype == MXFP4:  # the torch path
        stacked = torch.cat([p.view(groups, rows, -1) for p, rows in zip(parts, rows_per_group)],
                            1)
        return pack_ggml(qtype, stacked.reshape(-1, stacked.shape[-1]), int8_act)
    qs, d, m = torch.ops.hearth.repack_ggml([p.contiguous() for p in parts],
                                            list(rows_per_group), groups, qtype, 64)
    in_features = qs.shape[1] * (1 if qtype in (QTYPE_IDS["q8_0"], Q6_K) else 2)
    return PackedWeight(qtype, qs, d, m, qs.shape[0], in_features, int8_act)


@contextmanager
def single_threaded():
    """Run the block (or, as a decorator, the function) with one torch thread, then restore
    the count. For a model load's many small copies and elementwise passes: each is a parallel
    region ending at a barrier, and a cold start has the worker's HTTP process (and under
    `hearth up` other workers) running beside it, so one preempted thread stalls every op for a
    time slice. Measured beside a busy neighbour on the default model: its float weights 0.48 s
    on one thread vs 7-10 s on two, its packed decode weights 0.07 s vs 4.5 s."""
    saved = torch.get_num_threads()
    if saved > 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if saved > 1:
            torch.set_num_threads(saved)


@dataclass
class KernelThreads:
    """How many threads the kernels' work-sharing ops use in the current step: the runner's
    ThreadTuner sets it per step (1: run on the calling thread, no parallel region)."""

    count: int = 64


@dataclass(frozen=True)
class CpuKernels:
    """The ops of one loaded build (`torch.ops.hearth.*`) and which instruction set it uses."""

    variant: str  # avx512amx | avx512vnni | avx512 | avx2
    decode_split: int = 512  # context tokens per decode-attention work item
    threads: KernelThreads = field(default_factory=KernelThreads)

    @property
    def ops(self):
        return torch.ops.hearth

    def fast_prefill_attention(self, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
        """Whether `prefill_attention` runs its vector path for these heads: AVX-512 and AVX2
        builds, head dims 64 and 128, at most 48 query heads per KV head (its query tile holds
        48 rows). Elsewhere its plain loops are slower than torch's flash kernel, which the
        caller uses instead. On AVX2 (2-core EPYC, the default model's 9 x 64 heads, 2 threads)
        it ran 1.3-1.45x torch's flash kernel on 128-2k queries over 4k-16k cached tokens, and
        it reads the cache in place (torch's needs the prefix gathered first)."""
        return (self.variant.startswith("avx512") or self.variant == "avx2") and \
            head_dim in (64, 128) and num_heads // num_kv_heads <= 48

    def amx_prefill_attention(self, head_dim: int) -> bool:
        """Whether `amx_prefill_attention` serves bf16 prompt chunks of this head dim: the
        avx512amx build (its probe ran AMX tiles in this process's kind), head dim 64. On a 2k
        prompt of the default model's shape it takes ~0.65x torch's bf16 flash kernel, and it
        reads a cached prefix from the paged cache in place."""
        return self.variant == "avx512amx" and head_dim == 64

    def kquant_superblock_act(self) -> bool:
        """Whether this build multiplies Q4_K and Q6_K by 8-bit activations in whole
        super-blocks (the AVX2 tiles without VNNI: x quantized per 256 elements, integer sums
        to a super-block's end, llama.cpp's Q4_K x Q8_K): there the -a8 formats beat float32
        activations on K-quant rows and take Q6_K too (docs/formats.md). Elsewhere Q6_K
        always takes float32 activations."""
        return self.has("kquant_superblock_act") and bool(self.ops.kquant_superblock_act())

    def has(self, op: str) -> bool:
        """Whether the loaded build registers `op` (False before any build is loaded)."""
        return hasattr(torch.ops.hearth, op)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 bf16_out: bool = False) -> torch.Tensor:
        """norm(x) * weight (csrc/elementwise.h), float32 or (bf16_out) bfloat16."""
        return torch.ops.hearth.rms_norm(x, weight, eps, bf16_out)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float, bf16_out: bool = False) -> torch.Tensor:
        """residual += x in place; returns norm(residual) * weight."""
        return torch.ops.hearth.add_rms_norm(x, residual, weight, eps, bf16_out)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2I] -> silu(gate) * up [T, I]."""
        return torch.ops.hearth.silu_mul(gate_up)

    def moe_topk(self, logits: torch.Tensor, k: int, renormalize: bool,
                 counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Softmax router: (weights [T, k] float32, ids [T, k] int64); adds each pick to
        `counts` (an empty tensor: not counted)."""
        return torch.ops.hearth.moe_topk(logits, k, renormalize, counts)

    def mla_absorb(self, x: torch.Tensor, w: PackedWeight, rows: int) -> torch.Tensor:
        """x [T, H, K] through each head's `rows` rows of `w` ([H rows, K] packed) -> [T, H,
        rows] (csrc/mla_layers.h)."""
        return torch.ops.hearth.mla_absorb(x, w.qs, w.d, w.m, w.qtype, rows, self.threads.count,
                                           w.int8_act)

    def qlinear(self, x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
        return torch.ops.hearth.qlinear(x, w.qs, w.d, w.m, w.qtype, w.out_features,
                                        w.in_features, self.threads.count, w.int8_act)

    def dequant_rows(self, w: PackedWeight, rows: torch.Tensor,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows `rows` (int64) of `w` as `dtype` (float32 or bfloat16) values [len, K]: the
        exact values qlinear multiplies by (an embedding row lookup, or a prompt step's tile)."""
        return torch.ops.hearth.dequant_rows(w.qs, w.d, w.m, w.qtype, w.out_features,
                                             w.in_features, rows, dtype == torch.bfloat16,
                                             self.threads.count)

    def requantize_q8_0(self, w: PackedWeight) -> torch.Tensor:
        """`w`'s rows as ggml Q8_0 blocks [N, K/32 * 34] uint8: `quantize_q8_0` of its exact
        values, bit for bit, with no float copy of the whole weight."""
        return torch.ops.hearth.requantize_q8_0(w.qs, w.d, w.m, w.qtype, w.out_features,
                                                w.in_features, self.threads.count)

    def moe_experts(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor, expert_start: int,
                    q13: PackedWeight | None = None, q2: PackedWeight | None = None,
                    b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                    swiglu: tuple[float, float] | None = None) -> torch.Tensor:
        """A MoE layer's experts (csrc/moe.h): float32 [T, H]. With `q13`/`q2` (the experts'
        rows stacked, [E * 2I, H] and [E * H, I] in a block format) through qlinear's tiles
        (8-bit activations when `q13.int8_act`), else one GEMM per active expert on `w13`
        [E, 2I, H] / `w2` [E, H, I]. Optional per-expert biases `b13` [E, 2I] and `b2` [E, H];
        `swiglu` (alpha, limit): gpt-oss's clamped SwiGLU in place of silu(gate) * up."""
        q, types = [], []
        if q13 is not None:
            q, types = [q13.qs, q13.d, q13.m, q2.qs, q2.d, q2.m], [q13.qtype, q2.qtype]
        alpha, limit = swiglu if swiglu is not None else (1.702, 7.0)
        return torch.ops.hearth.moe_experts(x, w13, w2, topk_weights, topk_ids, expert_start,
                                            q, types, self.threads.count,
                                            q13 is not None and q13.int8_act, b13, b2,
                                            int(swiglu is not None), alpha, limit)


    def decode_layers(self, stack: "LlamaStack", x: torch.Tensor, residual: torch.Tensor | None,
                      k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                      step: "ShortQueryStep") -> tuple[torch.Tensor, torch.Tensor]:
        """`stack`'s Llama layers over a step of short queries in one call (csrc/decode_layers.h;
        `residual` None: the first layer's input is its own residual). Returns (hidden,
        residual) after the last layer; the K/V of the step's tokens are written."""
        return self.ops.decode_layers(
            x=x, residual=x if residual is None else residual, has_residual=residual is not None,
            weights=stack.weights, qtypes=stack.qtypes, dims=stack.dims, fdims=stack.fdims,
            rope_cos=stack.rope_cos, rope_sin=stack.rope_sin, k_caches=k_caches,
            v_caches=v_caches, positions=step.positions, slot_mapping=step.slot_mapping,
            block_tables=step.block_tables, context_lens=step.context_lens,
            query_lens=step.query_lens, split=self.decode_split, threads=self.threads.count,
            int8_act=stack.int8_act)

    def mla_decode_layers(self, stack: "MlaStack", x: torch.Tensor, residual: torch.Tensor | None,
                          caches: list[torch.Tensor], expert_counts: list[torch.Tensor],
                          step: "ShortQueryStep") -> tuple[torch.Tensor, torch.Tensor]:
        """`stack`'s MLA layers over a step of short queries in one call (csrc/mla_layers.h):
        `caches` the layers' latent caches, `expert_counts` each layer's router counts (an
        empty tensor: not counted). Returns (hidden, residual) after the last layer."""
        return self.ops.mla_decode_layers(
            x=x, residual=x if residual is None else residual, has_residual=residual is not None,
            weights=stack.weights, qtypes=stack.qtypes, dims=stack.dims, fdims=stack.fdims,
            expert_counts=expert_counts, rope_cos=stack.rope_cos, rope_sin=stack.rope_sin,
            caches=caches, positions=step.positions, slot_mapping=step.slot_mapping,
            block_tables=step.block_tables, context_lens=step.context_lens,
            query_lens=step.query_lens, split=self.decode_split, threads=self.threads.count,
            int8_act=stack.int8_act)


def available_variants() -> list[str]:
    """Usable builds on this machine, best first (empty when none is built)."""
    try:
        probe = json.loads(build_kernels.PROBE_FILE.read_text())
    except (OSError, ValueError):
        return []
    if probe.get("key") != build_kernels.build_key():
        return []
    return [v for v in build_kernels.VARIANTS
            if probe["variants"].get(v, {}).get("usable")
            and build_kernels.library_path(v).exists()]


def load_cpu_kernels(variant: str = "auto") -> CpuKernels | None:
    """Load one build ('auto': the best usable one). Returns None when there is none."""
    variants = available_variants()
    if variant != "auto":
        if variant not in variants:
            raise ValueError(f"CPU kernels {variant!r} are not built or not usable here "
                             f"(usable: {', '.join(variants) or 'none'}; run `make setup`)")
        variants = [variant]
    if not variants:
        return None
    chosen = variants[0]
    if not hasattr(torch.ops.hearth, "qlinear"):
        torch.ops.load_library(str(build_kernels.library_path(chosen)))
    loaded = {isa: v for v, isa in build_kernels.ISA.items()}[torch.ops.hearth.isa()]
    return CpuKernels(loaded)
