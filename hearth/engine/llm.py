"""Offline use: `LLM(model).generate(prompts, SamplingParams(...))`, all prompts as one batch."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from hearth.config import (CacheConfig, EngineConfig, ModelConfig, ParallelConfig,
                           SchedulerConfig)
from hearth.engine.engine import LLMEngine
from hearth.engine.executor import BuiltModel
from hearth.engine.request import Logprob
from hearth.engine.sampling_params import SamplingParams


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    finish_reason: str | None
    logprobs: list[Logprob] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids,
                "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "finish_reason": self.finish_reason}


class LLM:
    def __init__(self, model: str | None = None, *, config: EngineConfig | None = None,
                 checkpoint=None, prebuilt: BuiltModel | None = None, **overrides) -> None:
        """`overrides` go to the config part that owns them (e.g. dtype=, num_blocks=,
        max_num_batched_tokens=); `prebuilt`: a model to share (see `LLMEngine`)."""
        if config is None:
            config = make_engine_config(model, **overrides)
        self.engine = LLMEngine(config, checkpoint, prebuilt=prebuilt)
        self.tokenizer = self.engine.tokenizer
        self._next_id = 0

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 ) -> list[Completion]:
        """`prompts`: a string, a list of strings, or a list of token-id lists."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = []
        for prompt, p in zip(prompts, plist):
            token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            rid = f"offline-{self._next_id}"
            self._next_id += 1
            self.engine.add_request(rid, token_ids, p)
            ids.append(rid)
        return self._run(ids)

    def chat(self, messages_list: list[list[dict]], params: SamplingParams | None = None,
             tools: list[dict] | None = None) -> list[Completion]:
        texts = [self.tokenizer.apply_chat_template(m, tools=tools, add_generation_prompt=True)
                 for m in messages_list]
        return self.generate([self.tokenizer.encode(t) for t in texts], params)

    def _run(self, ids: list[str]) -> list[Completion]:
        results = {rid: Completion("", [], 0, 0, None) for rid in ids}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                c = results.get(out.request_id)
                if c is None:
                    continue
                c.text += out.new_text
                c.token_ids.extend(out.new_token_ids)
                c.logprobs.extend(out.new_logprobs)
                c.prompt_tokens, c.cached_tokens = out.num_prompt_tokens, out.num_cached_tokens
                if out.finished:
                    c.finish_reason = out.finish_reason
                    if out.error:
                        raise RuntimeError(f"request failed: {out.error}")
        return [results[rid] for rid in ids]


def make_engine_config(model: str | None = None, **kw) -> EngineConfig:
    """Route flat keyword overrides to the frozen config part that owns each field; a whole
    part can be given by its name (e.g. speculative=SpeculativeConfig(method="ngram"))."""
    parts = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
             "parallel": ParallelConfig}
    values: dict[str, dict] = {name: {} for name in parts}
    if model is not None:
        values["model"]["model"] = model
    whole = {k: kw.pop(k) for k in list(kw) if k in {f.name for f in fields(EngineConfig)}}
    for key, value in kw.items():
        owner = next((n for n, cls in parts.items() if key in {f.name for f in fields(cls)}), None)
        if owner is None:
            raise TypeError(f"unknown engine option {key!r}")
        values[owner][key] = value
    return EngineConfig(**{n: parts[n](**values[n]) for n in parts}, **whole)
