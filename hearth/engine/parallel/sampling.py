"""Sampling when the logits live on another rank (the last pipeline stage).

The driver turns each request that samples this step into a `SampleRow` (parameters, plus the
token history only when a penalty reads it, plus the grammar's allowed-token mask when guided);
the sampler rank samples with the same pure functions as `ModelRunner` and returns a
`SampleResult`. Seeded requests keep their generator on the sampler rank, created from the seed
at first use and dropped when the driver lists the request as finished, so a seeded request
draws the same numbers as it would in one process. (Unseeded requests share one generator; with
several micro-batches its draws are split differently than in one process.)
"""

from __future__ import annotations

import numpy as np
import torch

from hearth.engine.parallel.messages import SampleResult, SampleRow
from hearth.engine.request import Logprob, Request
from hearth.engine.runner import SampledToken
from hearth.engine.sampler import make_sampling_batch, sample


def make_sample_row(req: Request, index: int, vocab_size: int) -> SampleRow:
    p = req.params
    penalised = bool(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0)
    allowed = None
    if req.grammar is not None:
        row = torch.zeros(vocab_size)
        req.grammar.fill_mask(row)  # forbidden tokens become -inf
        allowed = np.packbits(~row.isinf().numpy()).tobytes()
    return SampleRow(
        index=index, request_id=req.request_id, temperature=p.temperature, top_p=p.top_p,
        top_k=p.top_k, min_p=p.min_p, presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty, repetition_penalty=p.repetition_penalty,
        logprobs=p.logprobs, seed=p.seed,
        prompt_ids=req.prompt_token_ids if penalised else [],
        output_ids=req.output_token_ids if penalised else [],
        allowed=allowed)


class RowSampler:
    """Lives on the sampler rank; holds the per-request generators of seeded requests."""

    def __init__(self, seed: int, vocab_size: int) -> None:
        self.shared_generator = torch.Generator(device="cpu").manual_seed(seed)
        self.vocab_size = vocab_size
        self.generators: dict[str, torch.Generator] = {}

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.generators.pop(request_id, None)

    def sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> SampleResult:
        """`logits`: [len(rows), vocab] float32 on CPU."""
        try:
            return self._sample(logits, rows)
        except Exception as exc:  # a bad row fails this step only; the ranks stay in step
            return SampleResult([], error=f"{type(exc).__name__}: {exc}")

    def _sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> SampleResult:
        for i, row in enumerate(rows):
            if row.allowed is not None:
                bits = np.unpackbits(np.frombuffer(row.allowed, dtype=np.uint8))
                allowed = torch.from_numpy(bits[: logits.shape[-1]].astype(bool))
                logits[i].masked_fill_(~allowed, float("-inf"))
        generators = [self._generator(row) for row in rows]
        batch = make_sampling_batch(rows, [(r.prompt_ids, r.output_ids) for r in rows],
                                    generators, logits.shape[-1])
        tokens, chosen, top = sample(logits, batch, self.shared_generator)
        return SampleResult(
            token_ids=tokens.tolist(),
            logprobs=chosen.tolist() if chosen is not None else [],
            top_ids=top.indices.tolist() if top is not None else [],
            top_logprobs=top.values.tolist() if top is not None else [])

    def _generator(self, row: SampleRow) -> torch.Generator | None:
        if row.seed is None:
            return None
        if row.request_id not in self.generators:
            self.generators[row.request_id] = torch.Generator().manual_seed(row.seed)
        return self.generators[row.request_id]


def to_sampled_tokens(result: SampleResult, requests: list[Request]) -> list[SampledToken]:
    """`requests[i]` is the request of the result's row i."""
    if result.error is not None:
        raise RuntimeError(f"sampling failed on the last pipeline stage: {result.error}")
    out = []
    for i, req in enumerate(requests):
        lp = None
        k = req.params.logprobs
        if k is not None:
            top = (list(zip(result.top_ids[i][:k], result.top_logprobs[i][:k]))
                   if k > 0 and result.top_ids else [])
            lp = Logprob(result.token_ids[i], result.logprobs[i], top)
        out.append(SampledToken(req, result.token_ids[i], lp))
    return out
