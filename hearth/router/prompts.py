"""A request's prompt token ids, as the workers will compute them, for the routing view.

Cache-aware routing compares the prompt's block hashes with each endpoint's cache view, so the
router needs the token ids before it picks an endpoint. With a local tokenizer (`--model`) the
router renders the chat template and tokenizes itself, exactly as a worker does (on its CPU
pool, off the event loop); without one it asks a healthy worker's `/tokenize`. A prediction
that is off only costs a cache miss: the truth comes back in the workers' usage and block
reports. Token ids a client sends are checked against the vocabulary when the router has the
tokenizer (else the worker checks them, and its 400 reaches the client).
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from hearth.router.health import ModelInfo
from hearth.api.harmony_prompt import render_prompt, resolve_chat_format
from hearth.api.edge import CpuPool, longest_token_chars
from hearth.api.protocol import ChatCompletionRequest, CompletionRequest, bad_request

AskWorker = Callable[[dict], Awaitable[dict]]  # POST /tokenize to some healthy worker


class PromptTokens:
    def __init__(self, tokenizer: Any | None, cpu: CpuPool, model: ModelInfo) -> None:
        self.tokenizer = tokenizer  # hearth.engine.text.tokenizer.Tokenizer, or None
        self.cpu = cpu
        self.model = model  # max_model_len, once a worker has reported it
        self._max_token_chars: int | None = None

    def _encode(self, text: str) -> list[int] | None:
        """(on the CPU pool) The ids, or None for a text too long to fit the context: the
        worker refuses it without tokenizing, so neither process spends time or memory on it."""
        if self._max_token_chars is None:
            self._max_token_chars = longest_token_chars(self.tokenizer)
        limit = self.model.max_model_len
        if limit is not None and len(text) > 2 * self._max_token_chars * limit:
            return None
        return self.tokenizer.encode(text)

    def _render_and_encode(self, request: ChatCompletionRequest, tools: list | None) -> list[int] | None:
        chat_format = resolve_chat_format("auto", getattr(self.tokenizer, "chat_template", None))
        prompt = render_prompt(self.tokenizer, chat_format, request.messages, tools,
                               request.add_generation_prompt, request.chat_template_kwargs,
                               request.reasoning_effort)
        return self._encode(prompt)

    async def chat(self, request: ChatCompletionRequest, raw: dict, ask: AskWorker) -> list[int] | None:
        tools = request.tools if request.tool_choice != "none" else None
        if self.tokenizer is not None:
            return await self.cpu.run(self._render_and_encode, request, tools or None)
        body = {"messages": raw["messages"], "add_generation_prompt": request.add_generation_prompt}
        if tools:
            body["tools"] = raw["tools"]
        return list((await ask(body))["tokens"])

    async def completion(self, request: CompletionRequest, ask: AskWorker) -> list[int] | None:
        """The single prompt's ids; None for a batch of prompts (never disaggregated)."""
        prompt = request.prompt
        if isinstance(prompt, str):
            if self.tokenizer is not None:
                return await self.cpu.run(self._encode, prompt)
            return list((await ask({"prompt": prompt}))["tokens"])
        if prompt and all(isinstance(t, int) for t in prompt):
            self._check_vocabulary(prompt)
            return list(prompt)
        if isinstance(prompt, list) and len(prompt) == 1:
            return await self.completion(request.model_copy(update={"prompt": prompt[0]}), ask)
        for item in prompt if isinstance(prompt, list) else ():
            if isinstance(item, list):
                self._check_vocabulary(item)
        return None

    def _check_vocabulary(self, token_ids: list[int]) -> None:
        if self.tokenizer is None:
            return  # the protocol bounds ids to 32 bits; the worker checks its vocabulary
        vocab_size = self.tokenizer.vocab_size
        if not all(0 <= t < vocab_size for t in token_ids):
            raise bad_request(f"prompt: token id outside the vocabulary [0, {vocab_size})",
                              param="prompt")
