"""Weight formats for the decode path: give each linear layer a copy of its weight in a ggml block
format that hearth's CPU kernels read directly (`qlinear`).

    none   float weights only (the exact reference)
    gguf   the GGUF file's own blocks where the kernels read that format (Q8_0, Q4_0, Q4_1):
           the same numbers the float reference dequantizes, at 4.5-8.5 bits per weight;
           other tensors (K-quants, float files) are requantized to Q8_0
    q8_0   every linear requantized to Q8_0 (32-element blocks, one fp16 scale): any checkpoint
    gguf-a8, q8_0-a8
           the same weights, with the activations of a few-row step quantized to 8 bits per
           32-element block (llama.cpp's way: integer dot products, VNNI where the CPU has it).
           Not exact: held to top-1 / KL bounds against fp32 like q8_0

With `gguf` on one rank, a weight lives once (`attach_file_blocks`, before any float weight
is read): every linear layer, and the embedding table, whose tensors the file stores in a
block format the kernels read (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K) is packed straight from the file's
map and never gets a float copy; one stored in another block format (Q5_K, Q5_0, ...; or a
merged QKV whose parts differ, as Q4_K_M's Q4_K q/k beside a Q6_K v) is requantized to Q8_0 a
slice of rows at a time, and has no float copy either (prompt steps then multiply by the Q8_0
values).
A blocks-only layer multiplies through `qlinear` when a step has few rows and through tiles
decoded from its blocks when it has many (hearth.models.layers.QuantizedWeight).

Elsewhere (float files, q8_0, TP) the float weights stay: a layer multiplies through `qlinear`
when a step has few rows (decode, weight-bandwidth bound) and through the float GEMM when it
has many (prefill, compute bound).
Invariant: a layer's `qweight`, dequantized, equals (gguf, kernel formats) or approximates to
8 bits (q8_0, requantized blocks) its float weight, row for row, including merged QKV / gate-up
rows and TP shards.
"""

from __future__ import annotations

import logging
import math
from typing import Callable

import torch

from hearth.models.moe import SparseMoeBlock
from hearth.models.registry import family_of
from hearth.models.weight_cache import PackSource, cache_key, load_packed
from hearth.ops.cpu_kernels import Q6_K, QTYPE_IDS, QTYPES, pack_ggml_parts, single_threaded

log = logging.getLogger("hearth.models")

QUANTIZATIONS = ("none", "gguf", "q8_0", "gguf-a8", "q8_0-a8")


def quantize_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] float -> [N, K/32 * 34] uint8 ggml Q8_0 blocks (d = max|w| / 127, q = round(w / d))."""
    n, k = weight.shape
    blocks = weight.float().reshape(n, k // 32, 32)
    d = (blocks.abs().amax(-1, keepdim=True) / 127.0).half()
    inv = torch.where(d.float() > 0, 1.0 / d.float(), torch.zeros_like(d.float()))
    q = (blocks * inv).round().clamp(-127, 127).to(torch.int8)
    packed = torch.cat([d.view(torch.uint8).reshape(n, k // 32, 2), q.view(torch.uint8)], -1)
    return packed.reshape(n, -1).contiguous()


def _merged_raw(checkpoint, names: list[str]) -> tuple[int, list[torch.Tensor]] | None:
    """(ggml type, the stored block rows of each tensor) of several tensors stacked (QKV,
    gate/up), if all share one kernel format."""
    raw_blocks = getattr(checkpoint, "raw_blocks", None)
    if raw_blocks is None:
        return None
    parts = [raw_blocks(n) for n in names]
    if any(p is None for p in parts) or len({p[0] for p in parts}) != 1:
        return None
    return parts[0][0], [p[1] for p in parts]


def attention_linears(attn, p: str) -> list[tuple[torch.nn.Module, list[str]]]:
    """The Llama attention's linears with the HF tensors their rows come from (a family with
    another attention has its own, in its quant hooks: `Family.quant`)."""
    return [(attn.qkv_proj, [p + f"self_attn.{x}_proj.weight" for x in "qkv"]),
            (attn.o_proj, [p + "self_attn.o_proj.weight"])]


# Where a layer's MLP tensors are named after "model.layers.{i}.": the dense MLP, the shared
# experts, the stacked experts; a family names its own in its quant hooks' MLP_NAMES (Llama 4:
# feed_forward.*)
MLP_NAMES = ("mlp.", "mlp.shared_experts.", "mlp.experts.")


def _mlp_names(model) -> tuple[str, str, str]:
    return getattr(family_of(model.arch.architecture).quant_hooks(), "MLP_NAMES", MLP_NAMES)


def _linear_sources(model, names: set[str]) -> list[tuple[torch.nn.Module, list[str]]]:
    """Each linear module of the model with the HF tensors its rows come from, in row order
    (`names`: the checkpoint's tensor names; a tied LM head reads the embedding; no sources:
    the float weights are what the kernels must see)."""
    hooks = family_of(model.arch.architecture).quant_hooks()
    linears = attention_linears if hooks is None else hooks.attention_linears
    dense, shared_experts, _ = _mlp_names(model)
    out = []
    for local, layer in enumerate(model.layers):
        p = f"model.layers.{model.layer_start + local}."
        out += linears(layer.self_attn, p)
        mlps = [(layer.mlp, p + dense)]
        if isinstance(layer.mlp, SparseMoeBlock):  # routed experts: quantize_experts
            shared = getattr(layer.mlp, "shared_experts", None)
            mlps = [] if shared is None else [(shared, p + shared_experts)]
        for mlp, m in mlps:
            out.append((mlp.gate_up_proj, [m + "gate_proj.weight", m + "up_proj.weight"]))
            out.append((mlp.down_proj, [m + "down_proj.weight"]))
    if model.lm_head is not None:
        tied = model.arch.tie_word_embeddings or "lm_head.weight" not in names
        out.append((model.lm_head, ["model.embed_tokens.weight" if tied else "lm_head.weight"]))
    return out


def _expert_raw(checkpoint, e: str, num_experts: int, int8_act: bool):
    """The stored blocks of a layer's stacked experts (a GGUF's ffn_*_exps, named under `e`) as
    the kernel's two packed weights: [gate_e | up_e] rows per expert (w13) and the down rows
    (w2), when all three share one format the kernels read; else None."""
    raw_blocks = getattr(checkpoint, "raw_blocks", None)
    names = [e + f"{x}_proj" for x in ("gate", "up", "down")]
    if raw_blocks is None or not all(n in checkpoint.tensor_names() for n in names):
        return None
    parts = [raw_blocks(n) for n in names]
    if any(part is None for part in parts) or len({part[0] for part in parts}) != 1:
        return None
    (qtype, gate), (_, up), (_, down) = parts
    inter = gate.shape[0] // num_experts
    return (pack_ggml_parts(qtype, [gate, up], [inter, inter], num_experts, int8_act),
            pack_ggml_parts(qtype, [down], [down.shape[0]], int8_act=int8_act))


def quantize_experts(model, checkpoint, quantization: str, kernels,
                     int8_act: bool = False) -> dict[str, int]:
    """Give each MoE layer's experts packed copies for few-row steps (the kernel's quantized
    path): the GGUF's own expert blocks where it stores them in a kernel format (one rank),
    else Q8_0 of the float weights. Experts whose widths are not multiples of 32 stay float."""
    counts: dict[str, int] = {}
    for local, layer in enumerate(model.layers):
        if not isinstance(layer.mlp, SparseMoeBlock):
            continue
        experts = layer.mlp.experts
        if experts.blocks_only:  # attach_file_blocks packed them from the file
            name = "experts-" + QTYPES[experts.qw13.qtype][1] + " (blocks only)"
            counts[name] = counts.get(name, 0) + 1
            continue
        w13, w2 = experts.w13.data, experts.w2.data  # [E, 2I, H], [E, H, I]
        if w13.shape[2] % 32 or w2.shape[2] % 32:
            counts["none"] = counts.get("none", 0) + 1
            continue
        packed = None
        if quantization == "gguf" and model.tp.size == 1:
            packed = _expert_raw(checkpoint, f"model.layers.{model.layer_start + local}."
                                 + _mlp_names(model)[2],
                                 experts.num_local, int8_act)
        if packed is None:
            q13, q2 = (quantize_q8_0(w.reshape(-1, w.shape[2])) for w in (w13, w2))
            packed = (pack_ggml_parts(QTYPE_IDS["q8_0"], [q13], [q13.shape[0]], 1, int8_act),
                      pack_ggml_parts(QTYPE_IDS["q8_0"], [q2], [q2.shape[0]], 1, int8_act))
        experts.set_quantized_experts(*packed, kernels)
        name = "experts-" + QTYPES[packed[0].qtype][1]
        counts[name] = counts.get(name, 0) + 1
    return counts


# Requantizing a tensor stored in another block format holds at most this many float32 values
# of it at once (output.weight of a 128k vocabulary is 525M values: 2.1 GB whole).
REQUANT_CHUNK_VALUES = 1 << 25
FLOAT_GGML_TYPES = (0, 1, 30)  # F32, F16, BF16


def _requantized_q8_0(checkpoint, name: str) -> torch.Tensor:
    """Q8_0 rows ([rows, cols / 32 * 34], a 3-D expert stack's rows expert-major) of a tensor
    stored in a block format the kernels do not read, dequantized and requantized a slice of
    rows at a time (never the whole tensor in float32)."""
    shape = checkpoint.stored_shape(name)
    rows, cols = math.prod(shape[:-1]), shape[-1]
    step = max(1, REQUANT_CHUNK_VALUES // cols)
    return torch.cat([quantize_q8_0(checkpoint.stored_rows(name, r, min(rows, r + step)))
                      for r in range(0, rows, step)])


def _file_blocks(checkpoint, sources: list[str], kernels, int8_act: bool = False
                 ) -> tuple[int, list[torch.Tensor]] | None:
    """(kernel type, block rows per source) for a layer whose tensors the file stores in blocks:
    as stored where all share a kernel format, else each requantized to Q8_0; None where any is
    stored as floats (or is not one stored tensor). `int8_act` on a build whose Q6_K takes
    float32 activations only: Q6_K too is requantized (the MoE op takes one activation format)."""
    types = [checkpoint.stored_type(n) for n in sources]
    if any(t is None or t in FLOAT_GGML_TYPES for t in types):
        return None
    merged = _merged_raw(checkpoint, sources)
    q6_k_a8 = kernels is not None and kernels.kquant_superblock_act()
    if merged is not None and not (int8_act and merged[0] == Q6_K and not q6_k_a8):
        return merged
    return QTYPE_IDS["q8_0"], [_q8_0_rows(checkpoint, n, kernels) for n in sources]


def _q8_0_rows(checkpoint, name: str, kernels) -> torch.Tensor:
    """Q8_0 block rows of one stored tensor: through the kernels (its blocks packed, then
    requantized in one pass, no float copy) where they read its format, else dequantized and
    requantized in torch a slice of rows at a time."""
    stored = checkpoint.raw_blocks(name) if kernels is not None else None
    if stored is None:
        return _requantized_q8_0(checkpoint, name)
    qtype, rows = stored
    return kernels.requantize_q8_0(pack_ggml_parts(qtype, [rows], [rows.shape[0]]))


def _file_experts(checkpoint, e: str, experts, int8_act: bool, kernels):
    """(w13, w2) PackedWeights of a MoE layer's experts from a GGUF's stacked expert blocks
    (ffn_{gate,up,down}_exps, named under `e`): gate/up and down each as stored where the
    kernels read its format, else requantized to Q8_0 (the op takes a format per stack); None
    where the file stores them as floats or in another layout."""
    names = [e + f"{x}_proj" for x in ("gate", "up", "down")]
    stacks = [_file_blocks(checkpoint, names[:2], kernels, int8_act),
              _file_blocks(checkpoint, names[2:], kernels, int8_act)]
    if any(s is None for s in stacks):
        return None
    (t13, (gate, up)), (t2, (down,)) = stacks
    inter = gate.shape[0] // experts.num_local
    return (pack_ggml_parts(t13, [gate, up], [inter, inter], experts.num_local, int8_act),
            pack_ggml_parts(t2, [down], [down.shape[0]], int8_act=int8_act))


def _released_after(checkpoint, sources: tuple[str, ...], pack: Callable) -> Callable:
    """`pack`, then (where it packed) the file map's pages of `sources` dropped: copied."""
    def packed():
        out = pack()
        if out is not None:
            for name in sources:
                checkpoint.release_pages(name)
        return out
    return packed


def _file_block_plan(model, checkpoint, int8_act: bool, kernels
                     ) -> list[tuple[PackSource, Callable, str]]:
    """What attach_file_blocks packs, in order: each weight's sources and packing, what takes
    the packed weights (returns whether it did) and its name's prefix in the counts. Read from
    the model's shapes alone (its float weights are not loaded yet)."""
    names = set(checkpoint.tensor_names())

    def linear(sources: list[str]) -> PackSource:
        def pack():
            blocks = _file_blocks(checkpoint, sources, kernels)
            return None if blocks is None else (pack_ggml_parts(
                blocks[0], blocks[1], [p.shape[0] for p in blocks[1]], int8_act=int8_act),)
        return PackSource(tuple(sources), _released_after(checkpoint, tuple(sources), pack))

    def embedding(packed) -> bool:
        if packed[0].out_features != embed.weight.shape[0]:
            return False
        embed.set_packed(packed[0], kernels)
        return True

    def experts_of(experts) -> Callable:
        def attach(packed) -> bool:
            experts.set_quantized_experts(*packed, kernels, blocks_only=True)
            return True
        return attach

    def linear_of(module) -> Callable:
        def attach(packed) -> bool:
            if packed[0].out_features != module.weight.shape[0]:
                return False  # e.g. a vocabulary padded for TP
            module.set_quantized(packed[0], kernels, blocks_only=True)
            return True
        return attach

    plan = []
    embed = getattr(model, "embed_tokens", None)
    if embed is not None and embed.weight.shape[1] % 32 == 0:
        plan.append((linear(["model.embed_tokens.weight"]), embedding, ""))
    for local, layer in enumerate(model.layers):
        if not isinstance(layer.mlp, SparseMoeBlock):
            continue
        experts = layer.mlp.experts
        e = f"model.layers.{model.layer_start + local}." + _mlp_names(model)[2]
        sources = tuple(e + f"{x}_proj" for x in ("gate", "up", "down"))
        if (not all(n in names for n in sources) or experts.w13.shape[2] % 32
                or experts.w2.shape[2] % 32):
            continue
        pack = _released_after(checkpoint, sources, lambda e=e, experts=experts: _file_experts(
            checkpoint, e, experts, int8_act, kernels))
        plan.append((PackSource(sources, pack), experts_of(experts), "experts-"))
    for module, sources in _linear_sources(model, names):
        if sources and module.weight.shape[1] % 32 == 0:
            plan.append((linear(sources), linear_of(module), ""))
    return plan


def attach_file_blocks(model, checkpoint, quantization: str, kernels,
                       cache_dir: str | None = None) -> dict[str, int]:
    """Keep every linear layer (and the embedding table, and MoE experts) whose tensors a GGUF
    stores in blocks only in blocks: packed from the file before the float weights load, their
    float parameters replaced by meta stand-ins that the load skips (module docstring). One
    rank, `gguf` formats; returns the number of layers per format. With `cache_dir` the packed
    weights are views of a cache file shared by every process on this host that loads the
    same model alike (hearth/models/weight_cache.py; the model's `weight_cache` says how)."""
    counts: dict[str, int] = {}
    if (not quantization.startswith("gguf") or model.tp.size != 1
            or not hasattr(checkpoint, "stored_type")):
        return counts
    int8_act = quantization.endswith("-a8")
    plan = _file_block_plan(model, checkpoint, int8_act, kernels)
    cached = None
    key = cache_key(checkpoint, model, int8_act, kernels) if cache_dir else None
    if key is not None:
        cached = load_packed(cache_dir, key, [item for item, _, _ in plan])
    if cached is not None:
        packed_by_sources, model.weight_cache = cached
    else:
        packed_by_sources = {}
    for item, attach, prefix in plan:
        if item.sources not in packed_by_sources:
            packed_by_sources[item.sources] = item.pack()
        packed = packed_by_sources[item.sources]
        if packed is not None and attach(packed):
            name = prefix + QTYPES[packed[0].qtype][1] + " (blocks only)"
            counts[name] = counts.get(name, 0) + 1
    return counts


def auto_quantization(checkpoint, kernels) -> str:
    """`auto` for a checkpoint the kernels serve: a GGUF's own blocks (`gguf`), with 8-bit
    activations (`gguf-a8`) where most of its block-format weights are Q4_K (a Q4_K_M / Q4_K_S
    file) or MXFP4 (gpt-oss's experts) and this build multiplies Q4_K in whole super-blocks
    (CpuKernels.kquant_superblock_act: the AVX2 tiles; at one activation row Q4_K ~1.4x the
    float32 tile's rows per second, measured in docs/formats.md, and a gpt-oss expert layer
    2.2x: 6.5 -> 3.0 ms on 2 threads); a float checkpoint: `none`."""
    if kernels is None or not hasattr(checkpoint, "raw_blocks"):
        return "none"
    if not (hasattr(checkpoint, "stored_type") and kernels.kquant_superblock_act()):
        return "gguf"
    elements: dict[int, int] = {}
    for name in checkpoint.tensor_names():
        qtype = checkpoint.stored_type(name)
        if qtype is not None and qtype not in FLOAT_GGML_TYPES:
            elements[qtype] = elements.get(qtype, 0) + math.prod(checkpoint.stored_shape(name))
    faster = sum(elements.get(QTYPE_IDS[q], 0) for q in ("q4_k", "mxfp4"))
    return "gguf-a8" if faster * 2 > sum(elements.values()) else "gguf"


@single_threaded()  # many small copies at a cold start, beside the HTTP process
def quantize_model(model, checkpoint, quantization: str, kernels) -> dict[str, int]:
    """Attach a PackedWeight to every linear layer that can take one; returns the number of
    layers per format (for the log and the tests)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization: unsupported {quantization!r}; "
                         f"choose from {', '.join(QUANTIZATIONS)} (or auto)")
    counts: dict[str, int] = {}
    if quantization == "none":
        return counts
    single_rank = model.tp.size == 1
    int8_act = quantization.endswith("-a8")
    quantization = quantization.removesuffix("-a8")
    for module, sources in _linear_sources(model, set(checkpoint.tensor_names())):
        if module.blocks_only:  # attach_file_blocks packed it from the file
            name = QTYPES[module.qweight.qtype][1] + " (blocks only)"
            counts[name] = counts.get(name, 0) + 1
            continue
        weight = module.weight.data
        if weight.shape[1] % 32:
            counts["none"] = counts.get("none", 0) + 1
            continue
        packed = None
        if quantization == "gguf" and single_rank and sources:
            packed = _merged_raw(checkpoint, sources)
            if packed is not None and sum(p.shape[0] for p in packed[1]) != weight.shape[0]:
                packed = None  # e.g. a vocabulary padded for TP
        if packed is None:
            packed = (QTYPE_IDS["q8_0"], [quantize_q8_0(weight)])
        qtype, parts = packed
        module.set_quantized(pack_ggml_parts(qtype, parts, [p.shape[0] for p in parts],
                                             int8_act=int8_act), kernels)
        name = QTYPES[packed[0]][1]
        counts[name] = counts.get(name, 0) + 1
    hooks = family_of(model.arch.architecture).quant_hooks()
    family_counts = {} if hooks is None else hooks.quantize_attention(model, kernels, int8_act)
    for name, count in [*quantize_experts(model, checkpoint, quantization, kernels,
                                          int8_act).items(), *family_counts.items()]:
        counts[name] = counts.get(name, 0) + count
    log.info("decode weights: %s%s", ", ".join(f"{n} x{c}" for n, c in sorted(counts.items())),
             ", 8-bit activations" if int8_act else "")
    return counts
