"""Where gpt-oss's checkpoint tensors go (transformers' names):

    model.layers.{i}.self_attn.{q,k,v,o}_proj.{weight,bias}
    model.layers.{i}.self_attn.sinks                          [num_heads] (cut like q's heads)
    model.layers.{i}.mlp.router.{weight,bias}                 [E, H], [E]
    model.layers.{i}.mlp.experts.gate_up_proj                 [E, H, 2I] (x @ W), columns
                                                              interleaved: gate 2j, up 2j+1
    model.layers.{i}.mlp.experts.gate_up_proj_bias            [E, 2I], interleaved alike
    model.layers.{i}.mlp.experts.down_proj                    [E, I, H]
    model.layers.{i}.mlp.experts.down_proj_bias               [E, H]

OpenAI's released folders store the two expert weights as MXFP4 instead
(`gate_up_proj_blocks` [E, 2I, H/32, 16] uint8 + `gate_up_proj_scales` [E, 2I, H/32] uint8,
`down_proj_blocks` [E, H, I/32, 16] + `down_proj_scales`): rows are the output features
(nn.Linear's layout), 32 values per block as 16 bytes of two e2m1 nibbles (low first), each
block scaled by 2^(scale - 127). They are dequantized as read (`mxfp4_to_float`).

A GGUF file (gguf.py) stores them split and stacked instead, nn.Linear rows:

    model.layers.{i}.mlp.experts.{gate,up}_proj          [E, I, H]   (+ _bias [E, I])
    model.layers.{i}.mlp.experts.down_proj               [E, H, I]   (+ _bias [E, H])
"""

from __future__ import annotations

import torch

from hearth.models.families.llama import loading as llama
from hearth.models.weights import WeightLoader

# e2m1 values of the 16 nibbles (sign in bit 3)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def load_weights(model, loader: WeightLoader) -> None:
    llama.load_weights(model, loader, load_layer)


def load_layer(model, loader: WeightLoader, index: int, layer) -> None:
    p = f"model.layers.{index}."
    llama.load_norms(loader, layer, p)
    llama.load_attention(loader, layer.self_attn, p)
    loader.fill(layer.self_attn.sinks, p + "self_attn.sinks", 0)
    moe = layer.mlp
    loader.fill(moe.gate, p + "mlp.router.weight")
    loader.fill(moe.router_bias, p + "mlp.router.bias")
    load_experts(loader, moe.experts, p + "mlp.experts.")


def mxfp4_to_float(blocks: torch.Tensor, scales: torch.Tensor, name: str) -> torch.Tensor:
    """[..., G, 16] uint8 blocks and [..., G] uint8 scales -> [..., G * 32] float32."""
    if blocks.dtype != torch.uint8 or blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"{name}: MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} and scales "
                         f"{tuple(scales.shape)} do not match ([..., G, 16] uint8, [..., G])")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)
    values = values.flatten(-2) * torch.exp2(scales.to(torch.float32) - 127)[..., None]
    return values.flatten(-2)


def expert_weight(loader: WeightLoader, e: str, part: str, want: tuple[int, int, int],
                  mine: slice, names: set[str]) -> torch.Tensor:
    """This rank's experts (`mine`) of an expert stack as nn.Linear rows, [E_local, out, in]:
    gate_up [.., 2I, H] (interleaved rows), down [.., H, I]; from the float tensor (stored
    [E, in, out]) or the MXFP4 blocks (only this rank's experts dequantized). `want`: the whole
    stack's [E, out, in]."""
    name = e + part
    if name in names:
        value = loader.get(name).transpose(1, 2)
        stored = tuple(value.shape)
    elif name + "_blocks" in names and name + "_scales" in names:
        blocks, scales = loader.get(name + "_blocks"), loader.get(name + "_scales")
        stored = (*blocks.shape[:-2], blocks.shape[-2] * 32)
    else:
        raise ValueError(f"checkpoint has no tensor {name} (nor MXFP4 {name}_blocks with "
                         f"{name}_scales)")
    if stored != want:
        raise ValueError(f"shape mismatch loading {name}: checkpoint (as [E, out, in]) "
                         f"{stored}, model expects {want}")
    if name in names:
        return value[mine]
    return mxfp4_to_float(blocks[mine], scales[mine], name)


def checked(loader: WeightLoader, name: str, want: tuple[int, ...]):
    value = loader.get(name)
    if tuple(value.shape) != want:
        raise ValueError(f"shape mismatch loading {name}: checkpoint {tuple(value.shape)}, "
                         f"model expects {want}")
    return value


def load_stacked_experts(loader: WeightLoader, experts, e: str, mine: slice, lo: int,
                         full: int) -> None:
    """The GGUF form (module docstring): gate and up already split, rows already out
    features; this rank's experts `mine` and its slice [lo, lo + inter) of I."""
    inter, num_experts, hidden = experts.inter, experts.num_experts, experts.w13.shape[2]
    cut = slice(lo, lo + inter)
    for half, part in ((slice(None, inter), "gate_proj"), (slice(inter, None), "up_proj")):
        experts.w13.data[:, half].copy_(checked(loader, e + part, (num_experts, full, hidden))
                                        [mine, cut])
        experts.b13.data[:, half].copy_(checked(loader, e + part + "_bias", (num_experts, full))
                                        [mine, cut])
    experts.w2.data.copy_(checked(loader, e + "down_proj", (num_experts, hidden, full))
                          [mine, :, cut])
    experts.b2.data.copy_(checked(loader, e + "down_proj_bias", (num_experts, hidden))[mine])


def load_experts(loader: WeightLoader, experts, e: str) -> None:
    """This rank's experts (FusedMoE: all experts cut along I, or with expert parallelism E/P
    whole ones), the interleaved gate/up columns split into [gate | up] rows."""
    names = set(loader.tensor_names())
    first, inter, local = experts.expert_start, experts.inter, experts.num_local
    full = inter if experts.expert_parallel else inter * experts.group.size
    lo = 0 if experts.expert_parallel else experts.group.rank * inter  # this rank's slice of I
    num_experts, hidden = experts.num_experts, experts.w13.shape[2]
    mine = slice(first, first + local)
    if e + "gate_proj" in names:
        load_stacked_experts(loader, experts, e, mine, lo, full)
        return
    gate_up = expert_weight(loader, e, "gate_up_proj", (num_experts, 2 * full, hidden), mine,
                            names)
    down = expert_weight(loader, e, "down_proj", (num_experts, hidden, full), mine, names)
    gate_up_bias, down_bias = loader.get(e + "gate_up_proj_bias"), loader.get(e + "down_proj_bias")
    for name, value, want in ((e + "gate_up_proj_bias", gate_up_bias, (num_experts, 2 * full)),
                              (e + "down_proj_bias", down_bias, (num_experts, hidden))):
        if tuple(value.shape) != want:
            raise ValueError(f"shape mismatch loading {name}: checkpoint {tuple(value.shape)}, "
                             f"model expects {want}")
    rows = slice(2 * lo, 2 * (lo + inter))  # this rank's interleaved gate/up rows
    w13, b13 = experts.w13.data, experts.b13.data  # [E_local, 2 I_loc, H], [E_local, 2 I_loc]
    w13[:, :inter].copy_(gate_up[:, rows][:, 0::2])
    w13[:, inter:].copy_(gate_up[:, rows][:, 1::2])
    b13[:, :inter].copy_(gate_up_bias[mine, rows][:, 0::2])
    b13[:, inter:].copy_(gate_up_bias[mine, rows][:, 1::2])
    experts.w2.data.copy_(down[:, :, lo:lo + inter])
    experts.b2.data.copy_(down_bias[mine])
