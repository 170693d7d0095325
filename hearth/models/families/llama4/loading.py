"""Where Llama 4's checkpoint tensors go (transformers' names, under `language_model.` in a
Llama4ForConditionalGeneration folder: hf_loader strips it and skips the vision tower):

    model.layers.{i}.self_attn.{q,k,v,o}_proj.*    (RoPE layers: q/k rows of each head from
                                                    interleaved pairs to rotate-half)
    model.layers.{i}.feed_forward.{gate,up,down}_proj.weight          dense layers
    model.layers.{i}.feed_forward.router.weight                       [E, H]
    model.layers.{i}.feed_forward.experts.gate_up_proj                [E, H, 2I] (x @ W)
    model.layers.{i}.feed_forward.experts.down_proj                   [E, I, H]
      or per expert feed_forward.experts.{j}.{gate,up,down}_proj.weight
      or stacked (GGUF) feed_forward.experts.{gate,up}_proj [E, I, H], down_proj [E, H, I]
    model.layers.{i}.feed_forward.shared_expert.{gate,up,down}_proj.weight
"""

from __future__ import annotations

from hearth.models.families.llama import loading as llama
from hearth.models.families.llama4.model import interleaved_to_half
from hearth.models.weights import WeightLoader


def load_weights(model, loader: WeightLoader) -> None:
    llama.load_weights(model, loader, load_layer)


def load_layer(model, loader: WeightLoader, index: int, layer) -> None:
    p = f"model.layers.{index}."
    llama.load_norms(loader, layer, p)
    attn = layer.self_attn
    llama.load_attention(loader, attn, p)
    if attn.use_rope:
        to_rotate_half(attn)
    f = p + "feed_forward."
    if not model.arch.is_moe_layer(index):
        llama.load_mlp(loader, layer.mlp, f)
        return
    moe = layer.mlp
    loader.fill(moe.gate, f + "router.weight")
    load_experts(loader, moe.experts, f + "experts.")
    llama.load_mlp(loader, moe.shared_experts, f + "shared_expert.")


def to_rotate_half(attn) -> None:
    """Permute the q and k rows (and biases) of every head from the checkpoint's interleaved
    rotary pairs to rotate-half; q . k is unchanged, v untouched."""
    perm = interleaved_to_half(attn.head_dim)
    rows = attn.q_size + attn.kv_size
    for param in (attn.qkv_proj.weight, attn.qkv_proj.bias):
        if param is None:
            continue
        qk = param.data[:rows]
        heads = qk.view(-1, attn.head_dim, *qk.shape[1:])
        heads.copy_(heads[:, perm].clone())


def load_experts(loader: WeightLoader, experts, e: str) -> None:
    """This rank's experts (FusedMoE: all experts cut along I, or with expert parallelism E/P
    whole ones) from transformers' packed tensors, per-expert ones or a GGUF's stacked ones."""
    names = set(loader.tensor_names())
    if experts.blocks_only:  # packed from a GGUF's stacks (quant.attach_file_blocks)
        loader.read.update(e + f"{x}_proj" for x in ("gate", "up", "down"))
        return
    first, inter, local = experts.expert_start, experts.inter, experts.num_local
    full = inter if experts.expert_parallel else inter * experts.group.size
    lo = 0 if experts.expert_parallel else experts.group.rank * inter  # this rank's slice of I
    w13, w2 = experts.w13.data, experts.w2.data  # [E_local, 2 I_loc, H], [E_local, H, I_loc]
    hidden = w13.shape[2]
    if e + "gate_up_proj" in names:
        gate_up, down = loader.get(e + "gate_up_proj"), loader.get(e + "down_proj")
        for name, value, want in ((e + "gate_up_proj", gate_up,
                                   (experts.num_experts, hidden, 2 * full)),
                                  (e + "down_proj", down, (experts.num_experts, full, hidden))):
            if tuple(value.shape) != want:
                raise ValueError(f"shape mismatch loading {name}: checkpoint "
                                 f"{tuple(value.shape)}, model expects {want}")
        gate_up, down = gate_up[first:first + local], down[first:first + local]
        w13[:, :inter].copy_(gate_up[:, :, lo:lo + inter].transpose(1, 2))
        w13[:, inter:].copy_(gate_up[:, :, full + lo:full + lo + inter].transpose(1, 2))
        w2.copy_(down[:, lo:lo + inter].transpose(1, 2))
        return
    if e + "gate_proj" in names:
        for j, part in enumerate(("gate_proj", "up_proj", "down_proj")):
            want = (experts.num_experts, *((full, hidden) if j < 2 else (hidden, full)))
            value = loader.get(e + part)
            if tuple(value.shape) != want:
                raise ValueError(f"shape mismatch loading {e + part}: checkpoint "
                                 f"{tuple(value.shape)}, model expects {want}")
            value = value[first:first + local]
            if j < 2:
                w13[:, j * inter:(j + 1) * inter].copy_(value[:, lo:lo + inter])
            else:
                w2.copy_(value[:, :, lo:lo + inter])
        return
    row_shard = None if experts.expert_parallel or experts.group.size == 1 else (
        0, experts.group.rank, experts.group.size)
    col_shard = None if row_shard is None else (1, *row_shard[1:])
    for j in range(local):
        q = e + f"{first + j}."
        for part in ("gate_proj", "up_proj", "down_proj"):
            if q + part + ".weight" not in names:
                raise ValueError(f"checkpoint has no tensor {q}{part}.weight (nor {e}gate_up_proj)")
        loader.read_into(w13[j, :inter], q + "gate_proj.weight", row_shard)
        loader.read_into(w13[j, inter:], q + "up_proj.weight", row_shard)
        loader.read_into(w2[j], q + "down_proj.weight", col_shard)
