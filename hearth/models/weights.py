"""Copy checkpoint tensors (HF names) into a model's (merged, sharded) parameters.

Each rank asks the checkpoint only for its own shard: `checkpoint.get(name, shard=(dim, rank,
world_size))`. Merged projections are filled part by part:

    qkv_proj.weight rows = [ q heads of this rank | k heads | v heads ]
    gate_up_proj.weight rows = [ gate slice | up slice ]

Every tensor of the checkpoint that belongs to this model part is read: one the model has no
place for (a bias of a projection the arch says has none, an unknown norm) is an error at load,
never silently dropped.

Tensors are decoded straight into the parameters (`Checkpoint.read_into`: rows of a merged
parameter are one tensor's destination), not into temporaries that are then concatenated and
copied: at a cold start each extra pass over the weights costs about as much as decoding them.
On one rank a tied LM head copies the decoded embedding rather than decoding it again.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import torch

from hearth.models.deepseek import DeepseekMoE, MLAAttention, interleaved_to_half
from hearth.models.layers import RotaryEmbedding
from hearth.models.llama import LlamaForCausalLM
from hearth.models.moe import SparseMoeBlock
from hearth.models.parallel_group import SINGLE, ParallelGroup
from hearth.models.registry import model_class
from hearth.ops.attention_backends import select_attention_backend
from hearth.ops.cpu_kernels import single_threaded


LOAD_THREADS = 2  # Python threads decoding tensors at a load (see load_weights)


def _vocab_shard(checkpoint, name: str, rank: int, size: int, shard: int) -> torch.Tensor:
    """Rows [rank * shard, (rank + 1) * shard) of a [vocab, hidden] tensor, zero-padded past the
    vocabulary. Only the shard is read when the vocabulary splits evenly."""
    if size == 1:
        return checkpoint.get(name)
    full = None
    if shard * size == checkpoint.arch.vocab_size:
        part = checkpoint.get(name, shard=(0, rank, size))
    else:
        full = checkpoint.get(name)
        part = full[rank * shard : (rank + 1) * shard]
    out = torch.zeros(shard, part.shape[1], dtype=part.dtype)
    out[: part.shape[0]] = part
    return out


def _copy(param: torch.nn.Parameter, value: torch.Tensor, name: str) -> None:
    if tuple(param.shape) != tuple(value.shape):
        raise ValueError(f"shape mismatch loading {name}: checkpoint {tuple(value.shape)}, "
                         f"model expects {tuple(param.shape)}")
    param.data.copy_(value)


def _fill_rows(param: torch.nn.Parameter, parts: list[tuple[str, tuple | None, int]],
               checkpoint) -> None:
    """Rows of `param`, in order, from each (tensor name, shard, number of rows) of `parts`:
    the merged QKV and gate/up projections and their biases. A part of another shape is the
    checkpoint's shape-mismatch error."""
    row = 0
    for name, shard, rows in parts:
        checkpoint.read_into(param.data[row : row + rows], name, shard)
        row += rows
    assert row == param.shape[0], (row, tuple(param.shape))


class _ReadRecorder:
    """The checkpoint, noting which tensor names were read."""

    def __init__(self, checkpoint) -> None:
        self.checkpoint, self.arch, self.read = checkpoint, checkpoint.arch, set()

    def get(self, name: str, shard=None) -> torch.Tensor:
        self.read.add(name)
        return self.checkpoint.get(name) if shard is None else self.checkpoint.get(name, shard=shard)

    def read_into(self, out: torch.Tensor, name: str, shard=None) -> None:
        self.read.add(name)
        if out.is_meta:  # a weight kept only in the file's blocks (quant.attach_file_blocks)
            return
        self.checkpoint.read_into(out, name, shard)

    def tensor_names(self) -> list[str]:
        return self.checkpoint.tensor_names()


def _check_all_read(model: LlamaForCausalLM, recorder: _ReadRecorder) -> None:
    """Raise if a tensor of this model part (its layers; embeddings/head on the end stages) was
    not read: the model would run without it and compute something else."""
    def belongs(name: str) -> bool:
        if name.startswith("model.layers."):
            return model.layer_start <= int(name.split(".")[2]) < model.layer_end
        if name == "model.embed_tokens.weight":
            return model.is_first
        if name == "lm_head.weight":  # a tied checkpoint may store a copy of the embeddings
            return model.is_last and not model.arch.tie_word_embeddings
        return model.is_last  # model.norm.* and anything unknown at the top level
    elsewhere = _owned_elsewhere(model)
    unused = sorted(n for n in recorder.tensor_names()
                    if belongs(n) and n not in recorder.read and not elsewhere(n))
    if unused:
        shown = ", ".join(unused[:5]) + (f" (and {len(unused) - 5} more)" if len(unused) > 5 else "")
        raise ValueError(f"checkpoint tensors the {model.arch.architecture} model has no place "
                         f"for: {shown}")


def load_weights(model: LlamaForCausalLM, checkpoint) -> None:
    recorder = checkpoint = _ReadRecorder(checkpoint)
    arch, tp = model.arch, model.tp
    rank, size = tp.rank, tp.size

    def part(name: str, shard_dim: int | None = None) -> tuple[str, tuple | None]:
        return name, (None if shard_dim is None or size == 1 else (shard_dim, rank, size))

    def kv_part(name: str) -> tuple[str, tuple | None]:
        if arch.num_kv_heads >= size:
            return part(name, 0)
        # Fewer KV heads than ranks: rank r uses (replicates) head r * num_kv_heads // size.
        head = rank * arch.num_kv_heads // size
        return name, (0, head, arch.num_kv_heads)

    def fill(param: torch.nn.Parameter, name: str, shard_dim: int | None = None) -> None:
        checkpoint.read_into(param.data, *part(name, shard_dim))

    def load_ends() -> None:
        names = set(checkpoint.tensor_names())
        head_name = ("lm_head.weight" if "lm_head.weight" in names and not arch.tie_word_embeddings
                     else "model.embed_tokens.weight")
        if size == 1:
            if model.embed_tokens is not None:
                fill(model.embed_tokens.weight, "model.embed_tokens.weight")
            if model.lm_head is not None:
                if head_name == "model.embed_tokens.weight" and model.embed_tokens is not None:
                    # tied: decoded once. A copy, not a shared parameter: a format may rewrite the
                    # head's float weight (hearth/models/quant.py) and must not touch the embedding.
                    recorder.read.add(head_name)
                    model.lm_head.weight.data.copy_(model.embed_tokens.weight.data)
                else:
                    fill(model.lm_head.weight, head_name)
        else:
            if model.embed_tokens is not None:
                emb = model.embed_tokens
                _copy(emb.weight, _vocab_shard(checkpoint, "model.embed_tokens.weight", rank, size,
                                               emb.shard), "model.embed_tokens.weight")
            if model.lm_head is not None:
                _copy(model.lm_head.weight, _vocab_shard(checkpoint, head_name, rank, size,
                                                         model.lm_head.shard), head_name)
        if model.norm is not None:
            fill(model.norm.weight, "model.norm.weight")

    def load_mla(attn: MLAAttention, p: str) -> None:
        """MLA's projections; the rotary rows of q and k_pe from interleaved to rotate-half."""
        a = p + "self_attn."
        parts = [(a + "kv_a_proj_with_mqa.{}", None, attn.latent_dim)]
        if attn.q_lora_rank:
            parts.insert(0, (a + "q_a_proj.{}", None, attn.q_lora_rank))
            fill(attn.q_a_layernorm.weight, a + "q_a_layernorm.weight")
            fill(attn.q_b_proj.weight, a + "q_b_proj.weight", 0)
            q_weight = attn.q_b_proj.weight.data
        else:
            fill(attn.q_proj.weight, a + "q_proj.weight", 0)
            q_weight = attn.q_proj.weight.data
        for kind, param in (("weight", attn.qkv_a_proj.weight), ("bias", attn.qkv_a_proj.bias)):
            if param is not None:
                _fill_rows(param, [(n.format(kind), s, r) for n, s, r in parts], checkpoint)
        fill(attn.kv_a_layernorm.weight, a + "kv_a_layernorm.weight")
        fill(attn.kv_b_proj.weight, a + "kv_b_proj.weight", 0)
        fill(attn.o_proj.weight, a + "o_proj.weight", 1)
        if attn.o_proj.bias is not None:
            fill(attn.o_proj.bias, a + "o_proj.bias")
        if arch.mla.rope_interleave:
            perm = interleaved_to_half(attn.rope)
            heads = q_weight.view(attn.num_heads, attn.qk_dim, -1)
            heads[:, attn.nope:] = heads[:, attn.nope:][:, perm].clone()
            for param in (attn.qkv_a_proj.weight, attn.qkv_a_proj.bias):
                if param is not None:
                    param.data[-attn.rope:] = param.data[-attn.rope:][perm].clone()

    def load_layer(local: int, layer) -> None:
        p = f"model.layers.{model.layer_start + local}."
        attn, mlp = layer.self_attn, layer.mlp
        fill(layer.input_layernorm.weight, p + "input_layernorm.weight")
        fill(layer.post_attention_layernorm.weight, p + "post_attention_layernorm.weight")
        if isinstance(attn, MLAAttention):
            load_mla(attn, p)
        else:
            load_attention(attn, p)
        if isinstance(mlp, SparseMoeBlock):
            load_moe_block(mlp, checkpoint, p)
            if isinstance(mlp, DeepseekMoE):
                if mlp.e_score_correction_bias is not None:
                    fill(mlp.e_score_correction_bias, p + "mlp.gate.e_score_correction_bias")
                if mlp.shared_experts is not None:
                    load_mlp(mlp.shared_experts, p + "mlp.shared_experts.")
            return
        load_mlp(mlp, p + "mlp.")

    def load_mlp(mlp, m: str) -> None:
        inter = mlp.gate_up_proj.weight.shape[0] // 2
        for kind, param in (("weight", mlp.gate_up_proj.weight),
                            ("bias", mlp.gate_up_proj.bias if arch.mlp_bias else None)):
            if param is not None:
                _fill_rows(param, [(*part(m + f"gate_proj.{kind}", 0), inter),
                                   (*part(m + f"up_proj.{kind}", 0), inter)], checkpoint)
        fill(mlp.down_proj.weight, m + "down_proj.weight", 1)
        if arch.mlp_bias:
            fill(mlp.down_proj.bias, m + "down_proj.bias")

    def load_attention(attn, p: str) -> None:
        q_rows, kv_rows = attn.q_size, attn.kv_size
        for kind, param in (("weight", attn.qkv_proj.weight),
                            ("bias", attn.qkv_proj.bias if arch.attention_bias else None)):
            if param is not None:
                _fill_rows(param, [(*part(p + f"self_attn.q_proj.{kind}", 0), q_rows),
                                   (*kv_part(p + f"self_attn.k_proj.{kind}"), kv_rows),
                                   (*kv_part(p + f"self_attn.v_proj.{kind}"), kv_rows)], checkpoint)
        fill(attn.o_proj.weight, p + "self_attn.o_proj.weight", 1)
        if arch.attention_out_bias:
            fill(attn.o_proj.bias, p + "self_attn.o_proj.bias")
        if arch.qk_norm:
            fill(attn.q_norm.weight, p + "self_attn.q_norm.weight")
            fill(attn.k_norm.weight, p + "self_attn.k_norm.weight")

    # Independent tasks (the embeddings, head and final norm; each decoder layer) on up to two
    # Python threads, each running torch on one thread (single_threaded in build_model): a
    # thread preempted by the HTTP process delays only its own task, while the other takes
    # the rest, so there is no barrier to stall on.
    tasks = [load_ends] + [lambda i=i, layer=layer: load_layer(i, layer)
                           for i, layer in enumerate(model.layers)]
    workers = min(LOAD_THREADS, len(tasks), os.cpu_count() or 1)
    if workers <= 1:
        for task in tasks:
            task()
    else:
        with ThreadPoolExecutor(workers, thread_name_prefix="hearth-load") as pool:
            for future in [pool.submit(task) for task in tasks]:
                future.result()
    _check_all_read(model, recorder)


# Where each layout keeps a layer's router and experts (p = "model.layers.{i}."):
#   packed (transformers 5):  mlp.experts.gate_up_proj [E, 2I, H], mlp.experts.down_proj [E, H, I]
#   stacked (GGUF's ffn_*_exps): mlp.experts.{gate,up,down}_proj [E, I, H] / [E, H, I]
#   per expert (transformers 4): mlp.experts.{j}.{gate,up,down}_proj.weight, Mixtral's
#       block_sparse_moe.experts.{j}.{w1,w3,w2}.weight (gate, up, down)
_ROUTER_NAMES = ("mlp.gate.weight", "block_sparse_moe.gate.weight")
_PER_EXPERT_NAMES = (("mlp.experts.{j}.", ("gate_proj.weight", "up_proj.weight", "down_proj.weight")),
                     ("block_sparse_moe.experts.{j}.", ("w1.weight", "w3.weight", "w2.weight")))


def load_moe_block(block: SparseMoeBlock, checkpoint, p: str) -> None:
    """Fill a sparse block's router and this rank's experts (FusedMoE's docstring: all experts
    cut along I, or with expert parallelism E/P whole experts) from any of the layouts above.
    A missing or mis-shaped expert is an error naming the tensor."""
    names = set(checkpoint.tensor_names())
    router = next((p + n for n in _ROUTER_NAMES if p + n in names), None)
    if router is None:
        raise ValueError(f"checkpoint has no router for MoE layer {p}: expected "
                         f"{p}{_ROUTER_NAMES[0]}")
    checkpoint.read_into(block.gate.data, router)
    experts = block.experts
    if experts.blocks_only:  # packed from the file's expert blocks (quant.attach_file_blocks)
        for part in ("gate", "up", "down"):
            checkpoint.read.add(p + f"mlp.experts.{part}_proj")
        return
    size, rank = experts.group.size, experts.group.rank
    first, inter = experts.expert_start, experts.inter
    w13, w2 = experts.w13.data, experts.w2.data  # [E_local, 2 I_loc, H], [E_local, H, I_loc]
    full_inter = inter if experts.expert_parallel else inter * size
    lo = 0 if experts.expert_parallel else rank * inter  # this rank's slice of I

    def stacked(name: str, rows_dim: int) -> torch.Tensor:
        """[E_local, ...] of a 3-D tensor holding every expert, cut to this rank's part."""
        value = checkpoint.get(name)
        e = block.gate.shape[0]
        want = (e, 2 * full_inter if "gate_up" in name else full_inter, w13.shape[2])
        want = want if rows_dim == 1 else (e, w13.shape[2], full_inter)
        if tuple(value.shape) != want:
            raise ValueError(f"shape mismatch loading {name}: checkpoint {tuple(value.shape)}, "
                             f"model expects {want}")
        return value[first:first + experts.num_local]

    if p + "mlp.experts.gate_up_proj" in names:
        gate_up = stacked(p + "mlp.experts.gate_up_proj", 1)
        w13[:, :inter].copy_(gate_up[:, lo:lo + inter])
        w13[:, inter:].copy_(gate_up[:, full_inter + lo:full_inter + lo + inter])
        w2.copy_(stacked(p + "mlp.experts.down_proj", 2)[:, :, lo:lo + inter])
        return
    if p + "mlp.experts.gate_proj" in names:
        w13[:, :inter].copy_(stacked(p + "mlp.experts.gate_proj", 1)[:, lo:lo + inter])
        w13[:, inter:].copy_(stacked(p + "mlp.experts.up_proj", 1)[:, lo:lo + inter])
        w2.copy_(stacked(p + "mlp.experts.down_proj", 2)[:, :, lo:lo + inter])
        return
    pattern, (gate, up, down) = next(
        ((pat, parts) for pat, parts in _PER_EXPERT_NAMES
         if p + pat.format(j=0) + parts[0] in names), _PER_EXPERT_NAMES[0])
    row_shard = None if experts.expert_parallel or size == 1 else (0, rank, size)
    col_shard = None if experts.expert_parallel or size == 1 else (1, rank, size)
    for local in range(experts.num_local):
        q = p + pattern.format(j=first + local)
        for name in (q + gate, q + up, q + down):
            if name not in names:
                raise ValueError(f"checkpoint has no tensor {name} (expert {first + local} of "
                                 f"MoE layer {p})")
        checkpoint.read_into(w13[local, :inter], q + gate, row_shard)
        checkpoint.read_into(w13[local, inter:], q + up, row_shard)
        checkpoint.read_into(w2[local], q + down, col_shard)


def _owned_elsewhere(model):
    """name -> whether it is a per-expert tensor of an expert another expert-parallel rank
    holds (so not read here)."""
    blocks = [m.experts for m in model.modules() if isinstance(m, SparseMoeBlock)]
    if not blocks or not blocks[0].expert_parallel:
        return lambda name: False
    mine = range(blocks[0].expert_start, blocks[0].expert_start + blocks[0].num_local)

    def elsewhere(name: str) -> bool:
        parts = name.split(".")
        if "experts" not in parts:
            return False
        index = parts.index("experts") + 1
        return index < len(parts) and parts[index].isdigit() and int(parts[index]) not in mine
    return elsewhere


def build_model(checkpoint, dtype: torch.dtype, device: str = "cpu",
                tp: ParallelGroup = SINGLE, layer_range: tuple[int, int] | None = None,
                expert_parallel: bool = False, before_load=None):
    """Instantiate the model without initialising weights, then load the checkpoint.
    `expert_parallel`: a MoE model's experts are split across the `tp` ranks whole instead of
    each cut along its width (hearth.models.moe); a dense model ignores it, as vLLM does.
    `before_load(model)` runs before any float weight is read: it may keep weights in blocks
    only (their parameters become meta stand-ins, which the load skips and which are never
    written, so their float pages are never touched)."""
    arch = checkpoint.arch
    extra = {"expert_parallel": True} if expert_parallel and arch.moe is not None else {}
    # Built straight on the device (parameters are torch.empty, filled by load_weights): the
    # meta-device + to_empty route pulls in torch's symbolic-shapes machinery, ~0.4 s of a cold
    # start.
    backend = select_attention_backend(device)  # CPU kernels, if any, come with use_kernels
    with torch.device(device):
        model = model_class(arch.architecture)(arch, tp, layer_range, attn_backend=backend,
                                               **extra)
    # The RoPE tables are computed on the CPU (see RotaryEmbedding): put them on the device.
    rope = RotaryEmbedding(arch.rotary_dim, arch.max_position_embeddings, arch.rope_theta,
                           arch.rope_scaling)
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.cos, module.sin = rope.cos.to(device), rope.sin.to(device)
    if before_load is not None:  # on every thread: its repacks are task pools (parallel_tasks:
        before_load(model)       # a preempted thread holds up only its own task), not barriers
    with single_threaded():  # small passes beside a busy HTTP process (its docstring)
        load_weights(model, checkpoint)
        return model.to(dtype=dtype).eval()
