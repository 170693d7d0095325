"""POST /v1/completions: the legacy text API (prompt text or token ids, batched prompts, echo).

Choice indexes follow OpenAI: with P prompts and n choices each, choice i*n + j is the j-th
sample of prompt i. Usage counts each prompt's tokens once.
"""

from __future__ import annotations

from typing import AsyncIterator, Awaitable, Callable

from hearth.engine.request import Logprob
from hearth.server.pd import hop_result, parse_hop
from hearth.api.protocol import CompletionRequest, bad_request, new_id
from hearth.api.chat_chunks import SSE_DONE, ChunkMaker, completion_logprobs, error_event
from hearth.server.serving import (
    MAX_CHOICES,
    ClientGone,
    RequestRun,
    abort_when_dropped,
    ServerState,
    check_model,
    check_n,
    check_prompt_chars,
    check_token_ids,
    raise_if_failed,
    response_format_guidance,
    sampling_params,
)


def _prompts(state: ServerState, request: CompletionRequest) -> list[tuple[list[int], str]]:
    """Each prompt as (token ids, text for echo); runs on the CPU pool."""
    prompt = request.prompt
    if isinstance(prompt, str):
        items: list = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        items = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise bad_request("prompt must not be empty", param="prompt")
    prompts = []
    for item in items:
        if isinstance(item, str):
            check_prompt_chars(state, item, "prompt")
            prompts.append((state.tokenizer.encode(item), item))
        else:
            check_token_ids(state, item, "prompt")
            prompts.append((list(item), state.tokenizer.decode(item) if request.echo else ""))
    return prompts


def _check_unsupported(request: CompletionRequest) -> None:
    if request.suffix:
        raise bad_request("suffix (insertion) is not supported", param="suffix")
    if request.best_of is not None and request.best_of != request.n:
        raise bad_request("best_of other than n is not supported", param="best_of")
    if request.echo and request.logprobs is not None:
        raise bad_request("echo with logprobs (prompt logprobs) is not supported", param="echo")


async def create_completion(
    state: ServerState, request: CompletionRequest,
    is_disconnected: Callable[[], Awaitable[bool]],
) -> dict | AsyncIterator[str]:
    check_model(state, request.model)
    check_n(request.n)
    _check_unsupported(request)
    hop = parse_hop(state.role, request.kv_transfer, request.n,
                    state.tokenizer.vocab_size)
    if hop is not None and hop.prompt_token_ids is not None:  # exactly as the first worker had it
        ids = list(hop.prompt_token_ids)
        prompts = [(ids, state.tokenizer.decode(ids) if request.echo and hop.is_resume else "")]
    else:
        prompts = await state.cpu.run(_prompts, state, request)
    if hop is not None and len(prompts) != 1:
        raise bad_request("kv_transfer: a disaggregated request has one prompt", param="prompt")
    if len(prompts) * request.n > MAX_CHOICES:
        raise bad_request(f"prompts x n must be at most {MAX_CHOICES}", param="n")
    guided = response_format_guidance(request.response_format)
    prompt_ids, params = [], []
    for ids, _ in prompts:
        for j in range(request.n):
            prompt_ids.append(ids)
            params.append(sampling_params(state, request, len(ids), request.max_tokens,
                                          request.logprobs, guided, seed_offset=j))
    run = RequestRun(state, new_id("cmpl"), None if request.stream else is_disconnected)
    await run.submit(prompt_ids, params, hop.spec if hop else None,
                     num_output_tokens=1 if hop and hop.is_decode else 0,
                     output_token_ids=hop.output_token_ids if hop else [])
    echoes = [text if request.echo else "" for _, text in prompts for _ in range(request.n)]
    first_of_prompt = [i * request.n for i in range(len(prompts))]
    if request.stream:
        return abort_when_dropped(_stream(state, request, run, echoes, first_of_prompt,
                                          prompt_ids), run)
    try:
        body = await _collect(state, request, run, echoes, first_of_prompt, prompt_ids)
        if hop is not None and not hop.is_resume:
            body["kv_transfer"] = hop_result(hop, run.choices[0], prompt_ids[0])
        return body
    finally:
        run.abort_unfinished()


async def _collect(state: ServerState, request: CompletionRequest, run: RequestRun,
                   echoes: list[str], first_of_prompt: list[int],
                   prompt_ids: list[list[int]]) -> dict:
    texts = list(echoes)
    logprobs: list[list[Logprob]] = [[] for _ in echoes]
    token_ids: list[list[int]] = [[] for _ in echoes]
    async for index, output in run.outputs():
        texts[index] += output.new_text
        logprobs[index] += output.new_logprobs
        token_ids[index] += output.new_token_ids
    choices = []
    for index, text in enumerate(texts):
        raise_if_failed(run.choices[index])
        choices.append({
            "index": index, "text": text,
            "logprobs": (completion_logprobs(logprobs[index], state.token_texts, 0)
                         if request.logprobs is not None else None),
            "finish_reason": run.choices[index].finish_reason,
        })
        if request.return_token_ids:  # vLLM's placement: on each choice
            choices[-1].update(prompt_token_ids=prompt_ids[index], token_ids=token_ids[index])
    return {"id": run.response_id, "object": "text_completion", "created": run.created,
            "model": state.model_name, "choices": choices, "system_fingerprint": None,
            "usage": run.usage(first_of_prompt).to_dict()}


async def _stream(state: ServerState, request: CompletionRequest, run: RequestRun,
                  echoes: list[str], first_of_prompt: list[int],
                  prompt_ids: list[list[int]]) -> AsyncIterator[str]:
    """With return_token_ids every output with new ids gets a chunk (text or not) carrying
    them; a choice's first chunk carries its `prompt_token_ids`."""
    include_usage = bool(request.stream_options and request.stream_options.include_usage)
    maker = ChunkMaker(run.response_id, run.created, state.model_name, chat=False,
                       include_usage=include_usage)
    offsets = [0] * len(echoes)
    with_ids = request.return_token_ids
    unsent_prompts = [ids if with_ids else None for ids in prompt_ids]
    try:
        for index, echo in enumerate(echoes):
            if echo:
                yield maker.text(index, echo, token_ids=[] if with_ids else None,
                                 prompt_token_ids=unsent_prompts[index])
                unsent_prompts[index] = None
        async for index, output in run.outputs():
            if output.finished and output.finish_reason == "error":
                yield error_event(output.error or "the engine failed this request")
                break
            logprobs = None
            if request.logprobs is not None and output.new_logprobs:
                logprobs = completion_logprobs(output.new_logprobs, state.token_texts, offsets[index])
            offsets[index] += len(output.new_text)
            if (output.new_text or logprobs or output.finished
                    or (with_ids and output.new_token_ids)):
                yield maker.text(index, output.new_text, logprobs,
                                 output.finish_reason if output.finished else None,
                                 token_ids=output.new_token_ids if with_ids else None,
                                 prompt_token_ids=unsent_prompts[index])
                unsent_prompts[index] = None
        else:
            if include_usage:
                yield maker.usage(run.usage(first_of_prompt))
        yield SSE_DONE
    except ClientGone:
        pass
    finally:
        run.abort_unfinished()
