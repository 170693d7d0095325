"""The model runner: owns the model and the KV tensors, runs a StepCommand (hearth/engine/step.py).

Like every rank of a T x P set it keeps the request slots' block tables (`StepReceiver`,
hearth/engine/step_state.py) and applies each command's changes first, whatever fails after.

The KV cache is one tensor `[num_layers, planes, num_blocks, block_size, heads, dim]` (layers of
this pipeline stage only; planes/heads/dim from `ModelArch.kv_cache_layout`: K and V of the
rank's KV heads, or MLA's one latent row), so a block's bytes for every layer are reachable by index
(the KV transfer code reads and writes whole blocks through `block_view`).
"""

from __future__ import annotations

import torch

from hearth.engine import host_memory
from hearth.engine.sampler import RowSampler
from hearth.engine.step import SampleResult, SampleRow, StepCommand, sample_row_positions
from hearth.engine.step_state import StepReceiver
from hearth.engine.thread_tuner import ThreadTuner
from hearth.models.moe import SparseMoeBlock
from hearth.ops import kv_quant
from hearth.ops.attention import build_attention_metadata


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# KV cache dtypes beyond the model dtypes: int8 or fp8 (e4m3) rows with a float32 scale each
# (kv_quant.py).
KV_DTYPES = {**DTYPES, "int8": torch.int8, "fp8": torch.float8_e4m3fn}


class ModelRunner:
    def __init__(self, model, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: str = "cpu", seed: int = 0, kernels=None) -> None:
        self.model = model
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = torch.device(device)
        arch = model.arch
        self.vocab_size = arch.vocab_size
        planes, heads, dim = arch.kv_cache_layout(model.tp.size)
        dim = kv_quant.row_width(dim, dtype)  # int8 / fp8: the values, then the row's scale
        # The CPU kernels read only slots that were written; the torch path attends over whole
        # gathered blocks (masked), where garbage could be NaN, so it gets zeros. Skipping the
        # fill saves ~0.3 s of a cold start per GB (fresh pages come zeroed from the OS anyway).
        alloc = torch.empty if kernels is not None else torch.zeros
        self.kv_cache = alloc(len(model.layers), planes, num_blocks, block_size, heads, dim,
                              dtype=dtype, device=self.device)
        prefault = None
        if self.device.type == "cpu":  # first touch off the request path (host_memory.py)
            prefault = host_memory.prefault(self.kv_cache)
        self._prefault = prefault
        self.sampler = RowSampler(seed, self.vocab_size)
        self.receiver = StepReceiver(block_size)
        # MoE layers count the tokens routed to each expert (the per-expert load metrics); a
        # model shared by several engines (`prebuilt`) keeps one count.
        self._moe_layers = {model.layer_start + i: layer.mlp
                            for i, layer in enumerate(model.layers)
                            if isinstance(layer.mlp, SparseMoeBlock)}
        for block in self._moe_layers.values():
            if block.expert_counts is None:
                block.expert_counts = torch.zeros(block.gate.shape[0], dtype=torch.int64,
                                                  device=self.device)
        self.num_micro_batches = 1  # micro-batches only pay off with pipeline stages
        # The kernels' thread count for decode-like steps, chosen by measurement (thread_tuner.py).
        self.thread_tuner = (ThreadTuner(kernels.threads, background=prefault)
                             if kernels is not None and torch.get_num_threads() > 1 else None)
        # EAGLE-3 drafting: the residual stream at these layers, for every token of a step
        self.aux_layers: tuple[int, ...] = ()
        self.aux_hidden: torch.Tensor | None = None  # [num_tokens, len(aux_layers) * hidden]

    def capture_aux_hidden(self, layers: tuple[int, ...]) -> None:
        """From now on each step leaves the residual stream entering `layers` (concatenated
        in that order) in `aux_hidden`; () stops it. Off, a step captures nothing."""
        self.aux_layers = tuple(layers)
        self.aux_hidden = None

    def close(self) -> None:
        """Stop the KV pool's prefault thread (the parallel executor stops its ranks here)."""
        if self._prefault is not None:
            self._prefault.stop()

    def expert_load(self) -> dict[int, list[int]]:
        """Tokens routed to each expert since start, per MoE layer (layer index -> counts; a
        token counts once per expert it picked). Empty for a dense model."""
        return {layer: block.expert_counts.tolist() for layer, block in self._moe_layers.items()}

    def block_view(self, block_id: int) -> torch.Tensor:
        """[num_layers, planes, block_size, heads, dim] view of one block."""
        return self.kv_cache[:, :, block_id]

    def prepare_inputs(self, cmd: StepCommand, block_tables: list[list[int]]):
        positions = [p for q, c in zip(cmd.query_lens, cmd.context_lens) for p in range(c - q, c)]
        meta = build_attention_metadata(cmd.query_lens, cmd.context_lens, block_tables,
                                        self.block_size, self.device)
        input_ids = torch.tensor(cmd.input_ids, dtype=torch.long, device=self.device)
        return input_ids, torch.tensor(positions, dtype=torch.long, device=self.device), meta

    @torch.inference_mode()
    def execute(self, cmd: StepCommand) -> SampleResult:
        step = self.receiver.receive(cmd)  # whole tables and histories
        input_ids, positions, meta = self.prepare_inputs(cmd, step.block_tables)
        kw = {}
        if self.aux_layers:
            self.aux_hidden = None
            kw["aux"] = aux = dict.fromkeys(self.aux_layers)
        if self.thread_tuner is None:
            hidden, _ = self.model(input_ids, positions, meta, self.kv_cache, **kw)
        else:
            hidden, _ = self.thread_tuner.run(meta.num_tokens, lambda: self.model(
                input_ids, positions, meta, self.kv_cache, **kw))
        if self.aux_layers:
            self.aux_hidden = torch.cat([aux[i] for i in self.aux_layers], dim=-1)
        return self.sample_from_hidden(cmd, hidden, step.samples)

    def sample_from_hidden(self, cmd: StepCommand, hidden: torch.Tensor,
                           samples: list[SampleRow]) -> SampleResult:
        """`samples`: the command's rows with their histories whole (`StepReceiver`)."""
        if not samples:
            return SampleResult([])
        rows = torch.tensor(sample_row_positions(cmd), device=hidden.device)
        logits = self.model.compute_logits(hidden[rows]).float().cpu()
        return self.sampler.sample(logits, samples)
