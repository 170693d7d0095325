"""Copy checkpoint tensors (HF names) into a model's (merged, sharded) parameters.

Each rank asks the checkpoint only for its own shard: `checkpoint.get(name, shard=(dim, rank,
world_size))`. Merged projections are filled part by part:

    qkv_proj.weight rows = [ q heads of this rank | k heads | v heads ]
    gate_up_proj.weight rows = [ gate slice | up slice ]

Every tensor of the checkpoint that belongs to this model part is read: one the model has no
place for (a bias of a projection the arch says has none, an unknown norm) is an error at load,
never silently dropped.
"""

from __future__ import annotations

import torch

from hearth.models.layers import RotaryEmbedding
from hearth.models.llama import LlamaForCausalLM
from hearth.ops.parallel import SINGLE, ParallelGroup


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


class _ReadRecorder:
    """The checkpoint, noting which tensor names were read."""

    def __init__(self, checkpoint) -> None:
        self.checkpoint, self.arch, self.read = checkpoint, checkpoint.arch, set()

    def get(self, name: str, shard=None) -> torch.Tensor:
        self.read.add(name)
        return self.checkpoint.get(name) if shard is None else self.checkpoint.get(name, shard=shard)

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
    unused = sorted(n for n in recorder.tensor_names() if belongs(n) and n not in recorder.read)
    if unused:
        shown = ", ".join(unused[:5]) + (f" (and {len(unused) - 5} more)" if len(unused) > 5 else "")
        raise ValueError(f"checkpoint tensors the {model.arch.architecture} model has no place "
                         f"for: {shown}")


def load_weights(model: LlamaForCausalLM, checkpoint) -> None:
    recorder = checkpoint = _ReadRecorder(checkpoint)
    arch, tp = model.arch, model.tp
    rank, size = tp.rank, tp.size

    def get(name: str, shard_dim: int | None = None) -> torch.Tensor:
        if shard_dim is None or size == 1:
            return checkpoint.get(name)
        return checkpoint.get(name, shard=(shard_dim, rank, size))

    def get_kv(name: str) -> torch.Tensor:
        if arch.num_kv_heads >= size:
            return get(name, 0)
        # Fewer KV heads than ranks: rank r uses (replicates) head r * num_kv_heads // size.
        head = rank * arch.num_kv_heads // size
        return checkpoint.get(name, shard=(0, head, arch.num_kv_heads))

    if model.embed_tokens is not None:
        emb = model.embed_tokens
        _copy(emb.weight, _vocab_shard(checkpoint, "model.embed_tokens.weight", rank, size,
                                       emb.shard), "model.embed_tokens.weight")
    if model.lm_head is not None:
        names = set(checkpoint.tensor_names())
        head_name = ("lm_head.weight" if "lm_head.weight" in names and not arch.tie_word_embeddings
                     else "model.embed_tokens.weight")
        _copy(model.lm_head.weight, _vocab_shard(checkpoint, head_name, rank, size,
                                                 model.lm_head.shard), head_name)
        _copy(model.norm.weight, checkpoint.get("model.norm.weight"), "model.norm.weight")

    for local, layer in enumerate(model.layers):
        p = f"model.layers.{model.layer_start + local}."
        attn = layer.self_attn
        qkv = [get(p + "self_attn.q_proj.weight", 0), get_kv(p + "self_attn.k_proj.weight"),
               get_kv(p + "self_attn.v_proj.weight")]
        _copy(attn.qkv_proj.weight, torch.cat(qkv), p + "self_attn.qkv")
        if arch.attention_bias:
            bias = [get(p + "self_attn.q_proj.bias", 0), get_kv(p + "self_attn.k_proj.bias"),
                    get_kv(p + "self_attn.v_proj.bias")]
            _copy(attn.qkv_proj.bias, torch.cat(bias), p + "self_attn.qkv bias")
        _copy(attn.o_proj.weight, get(p + "self_attn.o_proj.weight", 1), p + "self_attn.o_proj")
        if arch.attention_out_bias:
            _copy(attn.o_proj.bias, checkpoint.get(p + "self_attn.o_proj.bias"), p + "o_proj bias")
        if arch.qk_norm:
            _copy(attn.q_norm.weight, checkpoint.get(p + "self_attn.q_norm.weight"), p + "q_norm")
            _copy(attn.k_norm.weight, checkpoint.get(p + "self_attn.k_norm.weight"), p + "k_norm")
        gate_up = [get(p + "mlp.gate_proj.weight", 0), get(p + "mlp.up_proj.weight", 0)]
        _copy(layer.mlp.gate_up_proj.weight, torch.cat(gate_up), p + "mlp.gate_up")
        _copy(layer.mlp.down_proj.weight, get(p + "mlp.down_proj.weight", 1), p + "mlp.down_proj")
        if arch.mlp_bias:
            gate_up = [get(p + "mlp.gate_proj.bias", 0), get(p + "mlp.up_proj.bias", 0)]
            _copy(layer.mlp.gate_up_proj.bias, torch.cat(gate_up), p + "mlp.gate_up bias")
            _copy(layer.mlp.down_proj.bias, checkpoint.get(p + "mlp.down_proj.bias"),
                  p + "mlp.down_proj bias")
        _copy(layer.input_layernorm.weight, checkpoint.get(p + "input_layernorm.weight"),
              p + "input_layernorm")
        _copy(layer.post_attention_layernorm.weight,
              checkpoint.get(p + "post_attention_layernorm.weight"), p + "post_attention_layernorm")
    _check_all_read(model, recorder)


def build_model(checkpoint, dtype: torch.dtype, device: str = "cpu",
                tp: ParallelGroup = SINGLE, layer_range: tuple[int, int] | None = None):
    """Instantiate the model without initialising weights, then load the checkpoint."""
    # Built straight on the device (parameters are torch.empty, filled by load_weights): the
    # meta-device + to_empty route pulls in torch's symbolic-shapes machinery, ~0.4 s of a cold
    # start.
    with torch.device(device):
        model = LlamaForCausalLM(checkpoint.arch, tp, layer_range)
    # The RoPE tables are computed on the CPU (see RotaryEmbedding): put them on the device.
    arch = checkpoint.arch
    rope = RotaryEmbedding(arch.head_dim, arch.max_position_embeddings, arch.rope_theta,
                           arch.rope_scaling)
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.cos, module.sin = rope.cos.to(device), rope.sin.to(device)
    load_weights(model, checkpoint)
    return model.to(dtype=dtype).eval()
