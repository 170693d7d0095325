"""The model runner: owns the model and the KV tensors, turns a SchedulerOutput into tokens.

The KV cache is one tensor `[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`
(layers of this pipeline stage only), so a block's bytes for every layer are reachable by index
(the KV transfer code reads and writes whole blocks through `block_view`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hearth.engine.request import Logprob, Request
from hearth.engine.sampler import make_sampling_batch, sample
from hearth.engine.scheduler import SchedulerOutput
from hearth.engine.thread_tuner import ThreadTuner
from hearth.ops.attention import build_attention_metadata


@dataclass
class SampledToken:
    request: Request
    token_id: int
    logprob: Logprob | None


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def kv_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype) -> int:
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize


class ModelRunner:
    def __init__(self, model, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: str = "cpu", seed: int = 0, kernels=None) -> None:
        self.model = model
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = torch.device(device)
        arch = model.arch
        self.vocab_size = arch.vocab_size
        num_kv_heads = model.layers[0].self_attn.num_kv_heads if len(model.layers) else 1
        # The CPU kernels read only slots that were written; the torch path attends over whole
        # gathered blocks (masked), where garbage could be NaN, so it gets zeros. Skipping the
        # fill saves ~0.3 s of a cold start per GB (fresh pages come zeroed from the OS anyway).
        alloc = torch.empty if kernels is not None else torch.zeros
        self.kv_cache = alloc(len(model.layers), 2, num_blocks, block_size, num_kv_heads,
                              arch.head_dim, dtype=dtype, device=self.device)
        self.shared_generator = torch.Generator(device="cpu").manual_seed(seed)
        # The kernels' thread count for decode-like steps, chosen by measurement (thread_tuner.py).
        self.thread_tuner = (ThreadTuner(kernels.threads) if kernels is not None
                             and torch.get_num_threads() > 1 else None)

    def close(self) -> None:
        """Nothing to release in one process (the parallel executor stops its ranks here)."""

    def block_view(self, block_id: int) -> torch.Tensor:
        """[num_layers, 2, block_size, num_kv_heads, head_dim] view of one block."""
        return self.kv_cache[:, :, block_id]

    def prepare_inputs(self, out: SchedulerOutput):
        ids, positions, query_lens, context_lens, tables = [], [], [], [], []
        for req, num_new in out.scheduled:
            start = req.num_computed_tokens
            ids.extend(req.all_token_ids[start : start + num_new])
            positions.extend(range(start, start + num_new))
            query_lens.append(num_new)
            context_lens.append(start + num_new)
            tables.append(req.block_ids)
        meta = build_attention_metadata(query_lens, context_lens, tables, self.block_size,
                                        self.device)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        return input_ids, torch.tensor(positions, dtype=torch.long, device=self.device), meta

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> list[SampledToken]:
        input_ids, positions, meta = self.prepare_inputs(out)
        if self.thread_tuner is None:
            hidden, _ = self.model(input_ids, positions, meta, self.kv_cache)
        else:
            hidden, _ = self.thread_tuner.run(
                meta.num_tokens, lambda: self.model(input_ids, positions, meta, self.kv_cache))
        return self.sample_from_hidden(out, hidden)

    def sample_from_hidden(self, out: SchedulerOutput, hidden: torch.Tensor) -> list[SampledToken]:
        rows, reqs = [], []
        offset = 0
        for req, num_new in out.scheduled:
            offset += num_new
            if req.num_computed_tokens + num_new >= req.num_tokens:
                rows.append(offset - 1)
                reqs.append(req)
        if not reqs:
            return []
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=hidden.device)]).cpu()
        for i, req in enumerate(reqs):
            if req.grammar is not None:
                req.grammar.fill_mask(logits[i])
        batch = make_sampling_batch(
            [r.params for r in reqs],
            [(r.prompt_token_ids, r.output_token_ids) for r in reqs],
            [r.generator for r in reqs],
            logits.shape[-1],
        )
        tokens, chosen, top = sample(logits, batch, self.shared_generator)
        results = []
        for i, req in enumerate(reqs):
            lp = None
            if req.params.logprobs is not None:
                k = req.params.logprobs
                top_pairs = ([(int(t), float(v)) for v, t in zip(top.values[i, :k], top.indices[i, :k])]
                             if top is not None and k > 0 else [])
                lp = Logprob(int(tokens[i]), float(chosen[i]), top_pairs)
            results.append(SampledToken(req, int(tokens[i]), lp))
        return results
