"""POST /v1/chat/completions: messages -> prompt -> n engine requests -> response or SSE stream.

Each choice owns one OutputParser (hearth/server/output_parser.py): the reasoning parser when
`--reasoning-parser` is set, then a tool parser when tools are in play, fed with the engine's
text deltas; the streamed chunks and the non-streamed message come from the same parser events,
so both modes report the same reasoning, content and tool calls.

A guided request (a forced tool call, response_format) is constrained from its first token, so
its output has no reasoning block: it gets no reasoning parser.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator, Awaitable, Callable

from hearth.engine.request import Logprob, RequestOutput
from hearth.api.chat_prompt import uses_builtin_tool_format
from hearth.api.harmony_prompt import render_prompt
from hearth.api.chat_output import ChatEvent, ChatEvents, Failed, Finished
from hearth.server.pd import Hop, first_token_text, hop_result, parse_hop
from hearth.api.protocol import ChatCompletionRequest, bad_request, new_id
from hearth.api.chat_chunks import (
    SSE_DONE,
    ChunkMaker,
    chat_logprobs,
    error_event,
    tool_call_delta,
    tool_call_message,
)
from hearth.server.serving import (
    ClientGone,
    RequestRun,
    abort_when_dropped,
    ServerState,
    check_model,
    check_n,
    check_prompt_chars,
    raise_if_failed,
    response_format_guidance,
    sampling_params,
    stop_string,
    structured_outputs_guidance,
)
from hearth.api.reasoning import ReasoningDelta
from hearth.api.chat_chunks import Usage
from hearth.server.output_parser import OutputEvent, OutputParser, assemble_reasoning
from hearth.server.reasoning_parsers import PARSER_CLASSES as REASONING_CLASSES
from hearth.server.reasoning_parsers import make_reasoning_parser
from hearth.server.tool_grammar import tool_choice_guidance
from hearth.server.tool_parsers import (
    SPECIAL_TOKEN_PARSERS,
    ToolParser,
    assemble,
    make_tool_parser,
)


@dataclass
class ChatChoice:
    """One choice's parser state and what it has produced."""

    parser: ToolParser | None
    output: OutputParser | None = None  # None: the text is content as it comes
    flush_at_finish: bool = True  # False on a prefill hop: the output goes on on the decode side
    events: list[OutputEvent] = field(default_factory=list)
    logprobs: list[Logprob] = field(default_factory=list)
    unsent_logprobs: list[Logprob] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    # (output offset in characters, tokens) of each delta: which tokens were reasoning
    _delta_spans: list[tuple[int, int]] = field(default_factory=list)
    _num_chars: int = 0

    def feed(self, output: RequestOutput) -> list[OutputEvent]:
        self.token_ids += output.new_token_ids
        self.logprobs += output.new_logprobs
        self.unsent_logprobs += output.new_logprobs
        self._delta_spans.append((self._num_chars, len(output.new_token_ids)))
        self._num_chars += len(output.new_text)
        if self.output is None:
            new: list[OutputEvent] = [output.new_text] if output.new_text else []
        else:
            new = self.output.feed(output.new_text)
            if output.finished and self.flush_at_finish:
                new += self.output.finish()
        self.events += new
        return new

    def read_sent(self, text: str) -> None:
        """Parse the first token's text, which the prefill hop already sent: its events are
        dropped, the parsers' state carries on."""
        self._delta_spans.append((self._num_chars, 1))
        self._num_chars += len(text)
        if self.output is not None:
            self.output.feed(text)

    @property
    def has_tool_calls(self) -> bool:
        return self.parser is not None and self.parser.num_calls > 0

    @property
    def reasoning_tokens(self) -> int | None:
        """Output tokens that were reasoning (its markup included); None without a reasoning
        parser. A delta's tokens count with the side where the delta began (one token per delta
        but for speculative steps), as the parser's `is_reasoning_at` tells."""
        reasoning = self.output.reasoning if self.output is not None else None
        if reasoning is None:
            return None
        return sum(num for start, num in self._delta_spans if reasoning.is_reasoning_at(start))


def with_reasoning_tokens(state: ServerState, usage: Usage, choices: list[ChatChoice]) -> Usage:
    """`usage` with its reasoning tokens, where the server has a reasoning parser (0 for a
    guided request, which has none)."""
    if state.reasoning_parser is None:
        return usage
    return replace(usage, reasoning_tokens=sum(c.reasoning_tokens or 0 for c in choices))


def finish_reason(choice: ChatChoice, engine_reason: str | None) -> str:
    if choice.has_tool_calls and engine_reason == "stop":
        return "tool_calls"
    return engine_reason or "stop"


def _plan(state: ServerState, request: ChatCompletionRequest, hop: Hop | None,
          ) -> tuple[list[int], list, str | None, str | None]:
    """(prompt ids, per-choice SamplingParams, tool parser name or None, reasoning parser name
    or None); runs on the CPU pool."""
    check_model(state, request.model)
    tools = request.tools or None
    tool_choice = request.tool_choice or ("auto" if tools else "none")
    active_tools = tools if tool_choice != "none" else None
    harmony = state.chat_format == "harmony"
    parser = None
    if active_tools:
        builtin = not harmony and uses_builtin_tool_format(state.tokenizer, request.messages,
                                                           active_tools)
        parser = "hermes" if builtin else state.tool_parser
    prompt = render_prompt(state.tokenizer, state.chat_format, request.messages, active_tools,
                           request.add_generation_prompt, request.chat_template_kwargs,
                           request.reasoning_effort)
    if hop and hop.prompt_token_ids is not None:  # exactly as the first worker tokenized it
        prompt_ids = hop.prompt_token_ids
    else:
        check_prompt_chars(state, prompt, "messages")
        prompt_ids = state.tokenizer.encode(prompt)
    guided = None
    if parser is not None and (tool_choice != "auto" or state.config.guided_auto_tools):
        guided = tool_choice_guidance(tools, tool_choice, request.parallel_tool_calls, parser)
    elif not tools and tool_choice not in ("none", "auto"):
        raise bad_request("tool_choice requires tools", param="tool_choice")
    if guided is None:
        guided = response_format_guidance(request.response_format)
    if request.structured_outputs is not None:
        if guided is not None:
            raise bad_request("structured_outputs cannot be combined with response_format or a "
                              "forced tool call", param="structured_outputs")
        guided = structured_outputs_guidance(request.structured_outputs)
    # A <think> block cannot open inside guided output; harmony's channels are in the grammar.
    reasoning = state.reasoning_parser if guided is None or harmony else None
    content_parser = REASONING_CLASSES[reasoning].content_parser if reasoning else None
    if parser is None and content_parser is not None:  # it reads the format's markup
        parser = content_parser
    max_tokens = (request.max_completion_tokens if request.max_completion_tokens is not None
                  else request.max_tokens)
    top = request.top_logprobs or 0
    if request.top_logprobs is not None and not request.logprobs:
        raise bad_request("top_logprobs requires logprobs: true", param="top_logprobs")
    params = [
        sampling_params(state, request, len(prompt_ids), max_tokens,
                        top if request.logprobs else None, guided, seed_offset=i)
        for i in range(request.n)
    ]
    if parser in SPECIAL_TOKEN_PARSERS:  # the parser reads the markup tokens and drops them
        params = [replace(p, skip_special_tokens=False) for p in params]
    return prompt_ids, params, parser, reasoning


async def _start(state: ServerState, request: ChatCompletionRequest, hop: Hop | None,
                 is_disconnected: Callable[[], Awaitable[bool]] | None,
                 ) -> tuple[RequestRun, list[ChatChoice], list[int]]:
    """Plan the request, submit its engine requests and give each choice its parser."""
    # rendering and tokenizing are CPU work: off the event loop
    prompt_ids, params, parser_name, reasoning_name = await state.cpu.run(_plan, state, request,
                                                                          hop)
    run = RequestRun(state, new_id("chatcmpl"), is_disconnected)
    await run.submit([prompt_ids] * request.n, params, hop.spec if hop else None,
                     num_output_tokens=1 if hop and hop.is_decode else 0,
                     output_token_ids=hop.output_token_ids if hop else [])
    choices = []
    for _ in range(request.n):
        tools = make_tool_parser(parser_name) if parser_name else None
        reasoning = make_reasoning_parser(reasoning_name) if reasoning_name else None
        output = OutputParser(reasoning, tools) if tools or reasoning else None
        choices.append(ChatChoice(tools, output, flush_at_finish=not (hop and hop.is_prefill)))
    if hop and hop.is_decode and choices[0].output is not None:
        # the prefill hop sent what the first token produced: read it, drop the events
        choices[0].read_sent(first_token_text(state.tokenizer, hop, params[0].skip_special_tokens))
    return run, choices, prompt_ids


async def create_chat_completion(
    state: ServerState, request: ChatCompletionRequest,
    is_disconnected: Callable[[], Awaitable[bool]],
) -> dict | AsyncIterator[str]:
    check_n(request.n)
    hop = parse_hop(state.role, request.kv_transfer, request.n,
                    state.tokenizer.vocab_size)
    run, choices, prompt_ids = await _start(state, request, hop,
                                            None if request.stream else is_disconnected)
    if request.stream:
        return abort_when_dropped(_stream(state, request, run, choices, prompt_ids), run)
    try:
        body = await _collect(state, request, run, choices)
        if request.return_token_ids:  # vLLM's placement: the response, after usage
            body["prompt_token_ids"] = prompt_ids
        if hop is not None and not hop.is_resume:
            body["kv_transfer"] = hop_result(hop, run.choices[0], prompt_ids)
        return body
    finally:
        run.abort_unfinished()


async def chat_events(state: ServerState, request: ChatCompletionRequest,
                      is_disconnected: Callable[[], Awaitable[bool]] | None,
                      ) -> ChatEvents:
    """The internal output stream of a one-choice chat request (hearth/api/chat_output.py):
    what the Responses and Messages front doors translate. Planning and admission happen here,
    so a bad request raises before anything is sent."""
    if request.n != 1 or request.kv_transfer is not None:
        raise bad_request("this API has one choice and no kv_transfer", param="n")
    run, choices, _ = await _start(state, request, None, is_disconnected)
    return ChatEvents(abort_when_dropped(_events(state, run, choices[0]), run),
                      run.abort_unfinished)


async def _events(state: ServerState, run: RequestRun, choice: ChatChoice) -> AsyncIterator[ChatEvent]:
    try:
        async for _, output in run.outputs():
            for event in choice.feed(output):
                yield event
            if output.finished and output.finish_reason == "error":
                yield Failed(output.error or "the engine failed this request")
            elif output.finished:
                yield Finished(finish_reason(choice, output.finish_reason),
                               with_reasoning_tokens(state, run.usage(), [choice]), stop_string(output))
    finally:
        run.abort_unfinished()


async def _collect(state: ServerState, request: ChatCompletionRequest, run: RequestRun,
                   choices: list[ChatChoice]) -> dict:
    async for index, output in run.outputs():
        choices[index].feed(output)
    body_choices = []
    for index, choice in enumerate(choices):
        raise_if_failed(run.choices[index])
        content, calls = assemble([e for e in choice.events if not isinstance(e, ReasoningDelta)])
        message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
        if state.reasoning_parser is not None:
            message["reasoning_content"] = assemble_reasoning(choice.events)
        if calls:
            message["tool_calls"] = [tool_call_message(c) for c in calls]
        body_choices.append({
            "index": index,
            "message": message,
            "logprobs": chat_logprobs(choice.logprobs, state.token_texts) if request.logprobs else None,
            "finish_reason": finish_reason(choice, run.choices[index].finish_reason),
        })
        if run.choices[index].stop_string is not None:
            body_choices[-1]["stop_reason"] = run.choices[index].stop_string
        if request.return_token_ids:
            body_choices[-1]["token_ids"] = choice.token_ids
    return {
        "id": run.response_id, "object": "chat.completion", "created": run.created,
        "model": state.model_name, "choices": body_choices, "system_fingerprint": None,
        "usage": with_reasoning_tokens(state, run.usage(), choices).to_dict(),
    }


def _unsent_logprobs(state: ServerState, choice: ChatChoice, want_logprobs: bool) -> dict | None:
    if not (want_logprobs and choice.unsent_logprobs):
        return None
    logprobs = chat_logprobs(choice.unsent_logprobs, state.token_texts)
    choice.unsent_logprobs = []
    return logprobs


def _chunks_for(maker: ChunkMaker, state: ServerState, index: int, choice: ChatChoice,
                events: list[OutputEvent], want_logprobs: bool, token_ids: list[int] | None,
                ) -> list[str]:
    """One chunk per event; unsent logprobs ride on the first. With return_token_ids
    (`token_ids` not None) the output's ids ride on the first too ([] on the others), and ids
    with no event yet get a chunk of their own (empty delta): an id is never later than its
    text, and with logprobs the entries sent always match the ids sent."""
    chunks = []
    for event in events:
        logprobs = _unsent_logprobs(state, choice, want_logprobs)
        if isinstance(event, str):
            delta: dict[str, Any] = {"content": event}
        elif isinstance(event, ReasoningDelta):
            delta = {"reasoning_content": event.text}
        else:
            delta = {"tool_calls": [tool_call_delta(event)]}
        chunks.append(maker.chat(index, delta, logprobs, token_ids=token_ids))
        token_ids = None if token_ids is None else []
    if token_ids:
        chunks.append(maker.chat(index, {}, _unsent_logprobs(state, choice, want_logprobs),
                                 token_ids=token_ids))
    return chunks


async def _stream(state: ServerState, request: ChatCompletionRequest, run: RequestRun,
                  choices: list[ChatChoice], prompt_ids: list[int]) -> AsyncIterator[str]:
    include_usage = bool(request.stream_options and request.stream_options.include_usage)
    maker = ChunkMaker(run.response_id, run.created, state.model_name, chat=True,
                       include_usage=include_usage)
    with_ids = request.return_token_ids
    try:
        for index in range(len(choices)):
            yield maker.chat(index, {"role": "assistant", "content": ""},
                             prompt_token_ids=prompt_ids if with_ids else None)
        async for index, output in run.outputs():
            choice = choices[index]
            events = choice.feed(output)
            token_ids = output.new_token_ids if with_ids else None
            if output.finished and token_ids and not events:
                token_ids, last_ids = [], token_ids  # they ride on the finish chunk
            else:
                last_ids = [] if with_ids else None
            for chunk in _chunks_for(maker, state, index, choice, events, request.logprobs,
                                     token_ids):
                yield chunk
            if output.finished:
                if output.finish_reason == "error":
                    yield error_event(output.error or "the engine failed this request")
                    break
                yield maker.chat(index, {}, _unsent_logprobs(state, choice, request.logprobs),
                                 finish_reason(choice, output.finish_reason),
                                 stop_string(output), token_ids=last_ids)
        else:
            if include_usage:
                yield maker.usage(with_reasoning_tokens(state, run.usage(), choices))
        yield SSE_DONE
    except ClientGone:
        pass
    finally:
        run.abort_unfinished()
