"""Mixtral and Qwen3-MoE: the Llama decoder (Qwen3's with q/k norms) with a sparse MoE block in
place of the dense MLP in every layer the arch's `MoeSpec` marks sparse.

Everything else (attention over the paged cache, norms, RoPE, the pipeline stage split, the
embeddings and LM head) is the Llama family's; the expert layer is hearth.models.moe's.
"""

from __future__ import annotations

from torch import nn

from hearth.models.arch import ModelArch
from hearth.models.families.llama.model import LlamaForCausalLM, LlamaMLP
from hearth.models.moe import SparseMoeBlock
from hearth.models.parallel_group import SINGLE, ParallelGroup
from hearth.ops.attention_backends import AttentionBackend


class MoeLlamaForCausalLM(LlamaForCausalLM):
    def __init__(self, arch: ModelArch, tp: ParallelGroup = SINGLE,
                 layer_range: tuple[int, int] | None = None, expert_parallel: bool = False,
                 attn_backend: AttentionBackend | None = None):
        if arch.moe is None:
            raise ValueError(f"{arch.architecture}: a MoE model needs MoE settings")
        self.expert_parallel = expert_parallel  # read by make_mlp during the base __init__
        super().__init__(arch, tp, layer_range, attn_backend)

    def make_mlp(self, layer: int) -> nn.Module:
        if not self.arch.is_moe_layer(layer):
            return LlamaMLP(self.arch, self.tp)
        return SparseMoeBlock(self.arch, self.tp, self.expert_parallel)
