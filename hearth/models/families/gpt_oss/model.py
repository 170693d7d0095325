"""gpt-oss's model: the Llama decoder with gpt-oss's attention and MoE.

Attention (`GptOssAttention`): the Llama attention with biases on q/k/v/o (the arch's
attention_bias / attention_out_bias), RoPE in rotate-half order (as the checkpoint stores it),
and an `AttentionSpec` per layer: the layer's heads' learned sinks, plus a window of
`sliding_window` keys on sliding layers. The backend serves such a spec over only the blocks a
query sees (the CPU kernel backend through its torch path).

MoE (`GptOssMoe`), every layer: a biased router, the top-k logits, a softmax over those; the
experts (`GptOssExperts`) have biases on gate/up and down and a clamped SwiGLU

    gate, up = clamp(x W_gate + b_gate, max=L), clamp(x W_up + b_up, -L, L)
    out      = ((up + 1) * gate * sigmoid(alpha * gate)) W_down + b_down

The checkpoint interleaves gate and up columns; the loader stores them as hearth's [gate | up]
rows. The experts run FusedMoE's op with the biases and this activation (`expert_extras`):
hearth's expert kernel (`moe_experts`, float or packed experts) when kernels are loaded, else
`fused_experts_torch`. No layer takes the fused Llama decode kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hearth.models.arch import ModelArch
from hearth.models.families.llama.model import LlamaAttention, LlamaForCausalLM
from hearth.models.layers import RotaryEmbedding
from hearth.models.moe import FusedMoE, SparseMoeBlock
from hearth.models.parallel_group import SINGLE, ParallelGroup
from hearth.ops.attention import AttentionSpec
from hearth.ops.attention_backends import AttentionBackend


class GptOssAttention(LlamaAttention):
    def __init__(self, arch: ModelArch, tp: ParallelGroup, rotary: RotaryEmbedding,
                 backend: AttentionBackend, layer: int):
        super().__init__(arch, tp, rotary, backend)
        spec = arch.family_spec
        # [local heads]: this rank's heads' sink logits (the loader cuts them like q's rows)
        self.sinks = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
        window = spec.sliding_window if spec.sliding_layers[layer] else None
        # holds the Parameter itself: the loaded values and any later dtype cast are seen
        self.spec = AttentionSpec(window=window, sinks=self.sinks)


class GptOssExperts(FusedMoE):
    """FusedMoE's stacked experts (same sharding, [gate | up] rows, the same op: the kernel's
    float or packed experts, else `fused_experts_torch`) with gpt-oss's biases and clamped
    SwiGLU: b13 [E_local, 2 I_local] cut as w13's rows, b2 [E_local, H] whole. Cut along I (no
    expert parallelism), each rank's down output is a partial sum: only rank 0 adds b2."""

    def __init__(self, arch: ModelArch, tp: ParallelGroup, expert_parallel: bool) -> None:
        moe, spec = arch.moe, arch.family_spec
        super().__init__(moe.num_experts, arch.hidden_size, moe.expert_intermediate_size, tp,
                         expert_parallel)
        self.b13 = nn.Parameter(torch.empty(self.num_local, 2 * self.inter), requires_grad=False)
        self.b2 = nn.Parameter(torch.empty(self.num_local, arch.hidden_size), requires_grad=False)
        self.adds_down_bias = expert_parallel or tp.rank == 0
        self.alpha, self.limit = spec.swiglu_alpha, spec.swiglu_limit

    def expert_extras(self) -> dict:
        return dict(b13=self.b13, b2=self.b2 if self.adds_down_bias else None,
                    swiglu=(self.alpha, self.limit))


class GptOssMoe(SparseMoeBlock):
    """A biased router (`gate`, `router_bias`): softmax over each token's top-k logits, the
    weights scaling the experts' outputs."""

    def __init__(self, arch: ModelArch, tp: ParallelGroup, expert_parallel: bool = False) -> None:
        super().__init__(arch, tp, expert_parallel)
        self.router_bias = nn.Parameter(torch.empty(arch.moe.num_experts), requires_grad=False)
        self.experts = GptOssExperts(arch, tp, expert_parallel)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.gate.to(x.dtype), self.router_bias.to(x.dtype))
        top_logits, topk_ids = torch.topk(logits.float(), self.top_k, dim=-1)
        self.count(topk_ids)
        return torch.softmax(top_logits, dim=-1), topk_ids


class GptOssForCausalLM(LlamaForCausalLM):
    def __init__(self, arch: ModelArch, tp: ParallelGroup = SINGLE,
                 layer_range: tuple[int, int] | None = None, expert_parallel: bool = False,
                 attn_backend: AttentionBackend | None = None):
        if arch.moe is None or arch.family_spec is None:
            raise ValueError(f"{arch.architecture}: gpt-oss needs its MoE and layer settings")
        self.expert_parallel = expert_parallel  # read by make_mlp during the base __init__
        super().__init__(arch, tp, layer_range, attn_backend)

    def make_mlp(self, layer: int) -> nn.Module:
        return GptOssMoe(self.arch, self.tp, self.expert_parallel)

    def make_attention(self, layer: int, rotary: RotaryEmbedding) -> nn.Module:
        return GptOssAttention(self.arch, self.tp, rotary, self.attn_backend, layer)

    def enable_fused_decode(self) -> bool:
        """Never: the fused kernel has no sinks, windows, biases or these experts."""
        self._fused_all = None
        for layer in self.layers:
            layer._fused = None
        return False
