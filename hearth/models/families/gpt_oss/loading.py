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
block scaled by 2^(scale - 127). They stay in those bytes (`packed_mxfp4_experts`): repacked
to the CPU kernels' MXFP4 layout (4.25 bits per weight, hearth.ops.cpu_kernels.pack_mxfp4) as
the experts' only copy (FusedMoE's blocks-only experts, no float stacks). Where this rank's
part is not whole blocks (a tensor-parallel cut of I that is not a multiple of 32) they are
dequantized as read instead (`mxfp4_to_float`).

A GGUF file (gguf.py) stores them split and stacked instead, nn.Linear rows:

    model.layers.{i}.mlp.experts.{gate,up}_proj          [E, I, H]   (+ _bias [E, I])
    model.layers.{i}.mlp.experts.down_proj               [E, H, I]   (+ _bias [E, H])
"""

from __future__ import annotations

import torch

from hearth.models.families.llama import loading as llama
from hearth.models.weights import WeightLoader
from hearth.ops.cpu_kernels import PackedWeight, pack_mxfp4

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
                  mine: slice, names: set[str], decode: bool = True) -> torch.Tensor | None:
    """This rank's experts (`mine`) of an expert stack as nn.Linear rows, [E_local, out, in]:
    gate_up [.., 2I, H] (interleaved rows), down [.., H, I]; from the float tensor (stored
    [E, in, out]) or the MXFP4 blocks (only this rank's experts dequantized). `want`: the whole
    stack's [E, out, in]. With `decode` False only the checks run (returns None)."""
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
    if not decode:
        return None
    if name in names:
        return value[mine]
    return mxfp4_to_float(blocks[mine], scales[mine], name)


def packed_mxfp4_experts(loader: WeightLoader, e: str, mine: slice, rows: slice, lo: int,
                        inter: int, names: set[str]) -> tuple[PackedWeight, PackedWeight] | None:
    """This rank's experts straight from the MXFP4 blocks, as the kernels' packed stacks: w13
    [E_local * 2 I_loc, H] ([gate | up] rows per expert), w2 [E_local * H, I_loc]; None where
    the folder stores floats or this rank's columns of down are not whole 32-blocks (shapes
    are checked by `expert_weight` first)."""
    parts = [e + p for p in ("gate_up_proj", "down_proj")]
    if (any(p + "_blocks" not in names or p + "_scales" not in names for p in parts)
            or lo % 32 or inter % 32):
        return None
    gu_blocks = loader.get(parts[0] + "_blocks")[mine, rows]  # [E_local, 2 I_loc, H/32, 16]
    gu_scales = loader.get(parts[0] + "_scales")[mine, rows]
    gu_blocks = torch.cat([gu_blocks[:, 0::2], gu_blocks[:, 1::2]], 1)  # gate rows, up rows
    gu_scales = torch.cat([gu_scales[:, 0::2], gu_scales[:, 1::2]], 1)
    cols = slice(lo // 32, (lo + inter) // 32)  # this rank's blocks of I
    down_blocks = loader.get(parts[1] + "_blocks")[mine, :, cols]  # [E_local, H, I_loc/32, 16]
    down_scales = loader.get(parts[1] + "_scales")[mine, :, cols]
    return (pack_mxfp4(gu_blocks.flatten(0, 1), gu_scales.flatten(0, 1), interleaved=True),
            pack_mxfp4(down_blocks.flatten(0, 1), down_scales.flatten(0, 1), interleaved=True))


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
    if experts.blocks_only:  # packed from the file's stacks (quant.attach_file_blocks): no float
        loader.read.update(e + f"{x}_proj" for x in ("gate", "up", "down"))
    for half, part in ((slice(None, inter), "gate_proj"), (slice(inter, None), "up_proj")):
        if not experts.blocks_only:
            experts.w13.data[:, half].copy_(
                checked(loader, e + part, (num_experts, full, hidden))[mine, cut])
        experts.b13.data[:, half].copy_(checked(loader, e + part + "_bias", (num_experts, full))
                                        [mine, cut])
    if not experts.blocks_only:
        experts.w2.data.copy_(checked(loader, e + "down_proj", (num_experts, hidden, full))
                              [mine, :, cut])
    experts.b2.data.copy_(checked(loader, e + "down_proj_bias", (num_experts, hidden))[mine])


def load_experts(loader: WeightLoader, experts, e: str) -> None:
    """This rank's experts (FusedMoE: all experts cut along I, or with expert parallelism E/P
    whole ones), the interleaved gate/up columns split into [gate | up] rows; MXFP4 experts
    kept packed where they can be (`packed_mxfp4_experts`)."""
    names = set(loader.tensor_names())
    first, inter, local = experts.expert_start, experts.inter, experts.num_local
    full = inter if experts.expert_parallel else inter * experts.group.size
    lo = 0 if experts.expert_parallel else experts.group.rank * inter  # this rank's slice of I
    num_experts, hidden = experts.num_experts, experts.w13.shape[2]
    mine = slice(first, first + local)
    if e + "gate_proj" in names:
        load_stacked_experts(loader, experts, e, mine, lo, full)
        return
    rows = slice(2 * lo, 2 * (lo + inter))  # this rank's interleaved gate/up rows
    gate_up_bias, down_bias = loader.get(e + "gate_up_proj_bias"), loader.get(e + "down_proj_bias")
    for name, value, want in ((e + "gate_up_proj_bias", gate_up_bias, (num_experts, 2 * full)),
                              (e + "down_proj_bias", down_bias, (num_experts, hidden))):
        if tuple(value.shape) != want:
            raise ValueError(f"shape mismatch loading {name}: checkpoint {tuple(value.shape)}, "
                             f"model expects {want}")
    b13 = experts.b13.data  # [E_local, 2 I_loc]
    b13[:, :inter].copy_(gate_up_bias[mine, rows][:, 0::2])
    b13[:, inter:].copy_(gate_up_bias[mine, rows][:, 1::2])
    experts.b2.data.copy_(down_bias[mine])
    shapes = {"gate_up_proj": (num_experts, 2 * full, hidden),
              "down_proj": (num_experts, hidden, full)}
    for part, want in shapes.items():  # the checks, before anything is decoded
        expert_weight(loader, e, part, want, mine, names, decode=False)
    packed = packed_mxfp4_experts(loader, e, mine, rows, lo, inter, names)
    if packed is not None:  # the blocks are the only copy; the kernels are attached later
        experts.set_quantized_experts(*packed, experts.kernels, blocks_only=True)
        return
    gate_up, down = (expert_weight(loader, e, part, want, mine, names)
                     for part, want in shapes.items())
    w13 = experts.w13.data  # [E_local, 2 I_loc, H]
    w13[:, :inter].copy_(gate_up[:, rows][:, 0::2])
    w13[:, inter:].copy_(gate_up[:, rows][:, 1::2])
    experts.w2.data.copy_(down[:, :, lo:lo + inter])
