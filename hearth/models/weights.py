"""Build a model and copy checkpoint tensors (HF names) into its (merged, sharded) parameters.

The family (hearth/models/registry.py) gives the model class and its `load_weights(model,
loader)`, which says where each tensor goes; this module holds what every family's loading
shares: the `WeightLoader` (shards, merged rows, the read check, the load threads) and the MoE
experts' checkpoint layouts (`load_moe_block`). Each rank asks the checkpoint only for its own
shard: `checkpoint.get(name, shard=(dim, rank, world_size))`; merged projections are filled part
by part (`WeightLoader.fill_rows`; their layout: hearth/models/families/llama/loading.py).

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

from hearth.models.layers import RotaryEmbedding
from hearth.models.moe import SparseMoeBlock
from hearth.models.parallel_group import SINGLE, ParallelGroup
from hearth.models.registry import family_of
from hearth.ops.attention_backends import select_attention_backend
from hearth.ops.cpu_kernels import single_threaded


LOAD_THREADS = 2  # Python threads decoding tensors at a load (WeightLoader.run)


class WeightLoader:
    """The checkpoint as one model part on one tensor-parallel rank reads it: this rank's shard
    of each tensor decoded straight into a parameter, each name read noted (`check_all_read`).
    A family's `load_weights(model, loader)` fills its model through it."""

    def __init__(self, checkpoint, tp: ParallelGroup) -> None:
        self.checkpoint, self.arch, self.read = checkpoint, checkpoint.arch, set()
        self.rank, self.size = tp.rank, tp.size

    def get(self, name: str, shard=None) -> torch.Tensor:
        self.read.add(name)
        if shard is None:
            return self.checkpoint.get(name)
        return self.checkpoint.get(name, shard=shard)

    def read_into(self, out: torch.Tensor, name: str, shard=None) -> None:
        self.read.add(name)
        if out.is_meta:  # a weight kept only in the file's blocks (quant.attach_file_blocks)
            return
        self.checkpoint.read_into(out, name, shard)

    def tensor_names(self) -> list[str]:
        return self.checkpoint.tensor_names()

    def part(self, name: str, shard_dim: int | None = None) -> tuple[str, tuple | None]:
        """(name, this rank's shard along `shard_dim`; None: whole)."""
        return name, (None if shard_dim is None or self.size == 1
                      else (shard_dim, self.rank, self.size))

    def kv_part(self, name: str) -> tuple[str, tuple | None]:
        """A K/V projection's rows of this rank: its share of the KV heads, or with fewer KV heads
        than ranks, the one head rank r uses (replicates), r * num_kv_heads // size."""
        num_kv_heads = self.arch.num_kv_heads
        if num_kv_heads >= self.size:
            return self.part(name, 0)
        return name, (0, self.rank * num_kv_heads // self.size, num_kv_heads)

    def fill(self, param: torch.nn.Parameter, name: str, shard_dim: int | None = None) -> None:
        self.read_into(param.data, *self.part(name, shard_dim))

    def fill_rows(self, param: torch.nn.Parameter,
                  parts: list[tuple[str, tuple | None, int]]) -> None:
        """Rows of `param`, in order, from each (tensor name, shard, number of rows) of `parts`:
        merged projections (QKV, gate/up) and their biases. A part of another shape is the
        checkpoint's shape-mismatch error."""
        row = 0
        for name, shard, rows in parts:
            self.read_into(param.data[row : row + rows], name, shard)
            row += rows
        assert row == param.shape[0], (row, tuple(param.shape))

    def fill_vocab_rows(self, param: torch.nn.Parameter, name: str) -> None:
        """This rank's rows of a [vocab, hidden] tensor, zero-padded past the vocabulary. Only
        the shard is read when the vocabulary splits evenly."""
        shard = param.shape[0]
        if shard * self.size == self.arch.vocab_size:
            part = self.get(name, shard=(0, self.rank, self.size))
        else:
            part = self.get(name)[self.rank * shard : (self.rank + 1) * shard]
        if part.shape[1:] != param.shape[1:]:
            raise ValueError(f"shape mismatch loading {name}: checkpoint rows "
                             f"{tuple(part.shape[1:])}, model expects {tuple(param.shape[1:])}")
        param.data.zero_()
        param.data[: part.shape[0]].copy_(part)

    def run(self, tasks: list) -> None:
        """Independent load tasks (the embeddings, head and final norm; each decoder layer) on up
        to LOAD_THREADS Python threads, each running torch on one thread (single_threaded in
        build_model): a thread preempted by the HTTP process delays only its own task, while
        the other takes the rest, so there is no barrier to stall on."""
        workers = min(LOAD_THREADS, len(tasks), os.cpu_count() or 1)
        if workers <= 1:
            for task in tasks:
                task()
            return
        with ThreadPoolExecutor(workers, thread_name_prefix="hearth-load") as pool:
            for future in [pool.submit(task) for task in tasks]:
                future.result()

    def check_all_read(self, model) -> None:
        """Raise if a tensor of this model part (its layers; embeddings/head on the end stages)
        was not read: the model would run without it and compute something else."""
        def belongs(name: str) -> bool:
            if name.startswith("model.layers."):
                return model.layer_start <= int(name.split(".")[2]) < model.layer_end
            if name == "model.embed_tokens.weight":
                return model.is_first
            if name == "lm_head.weight":  # a tied checkpoint may store a copy of the embeddings
                return model.is_last and not model.arch.tie_word_embeddings
            return model.is_last  # model.norm.* and anything unknown at the top level
        elsewhere = _owned_elsewhere(model)
        unused = sorted(n for n in self.tensor_names()
                        if belongs(n) and n not in self.read and not elsewhere(n))
        if unused:
            shown = ", ".join(unused[:5]) + (f" (and {len(unused) - 5} more)"
                                             if len(unused) > 5 else "")
            raise ValueError(f"checkpoint tensors the {model.arch.architecture} model has no "
                             f"place for: {shown}")


# Where each layout keeps a layer's router and experts (p = "model.layers.{i}."):
#   packed (transformers 5):  mlp.experts.gate_up_proj [E, 2I, H], mlp.experts.down_proj [E, H, I]
#   stacked (GGUF's ffn_*_exps): mlp.experts.{gate,up,down}_proj [E, I, H] / [E, H, I]
#   per expert (transformers 4): mlp.experts.{j}.{gate,up,down}_proj.weight, Mixtral's
#       block_sparse_moe.experts.{j}.{w1,w3,w2}.weight (gate, up, down)
_ROUTER_NAMES = ("mlp.gate.weight", "block_sparse_moe.gate.weight")
_PER_EXPERT_NAMES = (("mlp.experts.{j}.", ("gate_proj.weight", "up_proj.weight", "down_proj.weight")),
                     ("block_sparse_moe.experts.{j}.", ("w1.weight", "w3.weight", "w2.weight")))


def load_moe_block(block: SparseMoeBlock, checkpoint: WeightLoader, p: str) -> None:
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
    family = family_of(arch.architecture)
    with torch.device(device):
        model = family.model_class()(arch, tp, layer_range, attn_backend=backend, **extra)
    # The RoPE tables are computed on the CPU (see RotaryEmbedding): put them on the device.
    rope = RotaryEmbedding(arch.rotary_dim, arch.max_position_embeddings, arch.rope_theta,
                           arch.rope_scaling)
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.cos, module.sin = rope.cos.to(device), rope.sin.to(device)
    if before_load is not None:  # on every thread: its repacks are task pools (parallel_tasks:
        before_load(model)       # a preempted thread holds up only its own task), not barriers
    with single_threaded():  # small passes beside a busy HTTP process (its docstring)
        loader = WeightLoader(checkpoint, tp)
        family.weight_loader()(model, loader)
        loader.check_all_read(model)
        return model.to(dtype=dtype).eval()
