"""A request's prompt token ids, as the workers will compute them, for the routing view.

Cache-aware routing compares the prompt's block hashes with each endpoint's cache view, so the
router needs the token ids before it picks an endpoint. With a local tokenizer (`--model`) the
router renders the chat template and tokenizes itself, exactly as a worker does; without one it
asks a healthy worker's `/tokenize`. A prediction that is off only costs a cache miss: the
truth comes back in the workers' usage and block reports.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from hearth.server.chat import render_chat_prompt
from hearth.server.protocol import ChatCompletionRequest, CompletionRequest

AskWorker = Callable[[dict], Awaitable[dict]]  # POST /tokenize to some healthy worker


class PromptTokens:
    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer  # hearth.engine.tokenizer.Tokenizer, or None

    async def chat(self, request: ChatCompletionRequest, raw: dict, ask: AskWorker) -> list[int]:
        tools = request.tools if request.tool_choice != "none" else None
        if self.tokenizer is not None:
            prompt = render_chat_prompt(self.tokenizer, request.messages, tools or None,
                                        request.add_generation_prompt, request.chat_template_kwargs)
            return self.tokenizer.encode(prompt)
        body = {"messages": raw["messages"], "add_generation_prompt": request.add_generation_prompt}
        if tools:
            body["tools"] = raw["tools"]
        return list((await ask(body))["tokens"])

    async def completion(self, request: CompletionRequest, ask: AskWorker) -> list[int] | None:
        """The single prompt's ids; None for a batch of prompts (never disaggregated)."""
        prompt = request.prompt
        if isinstance(prompt, str):
            if self.tokenizer is not None:
                return self.tokenizer.encode(prompt)
            return list((await ask({"prompt": prompt}))["tokens"])
        if prompt and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        if isinstance(prompt, list) and len(prompt) == 1:
            return await self.completion(request.model_copy(update={"prompt": prompt[0]}), ask)
        return None
