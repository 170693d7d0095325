"""The harmony format (gpt-oss): the prompt renderer writes exactly the expected text, and the
output parsers (`--reasoning-parser openai_gptoss` + `--tool-call-parser openai`) split output
into reasoning, content and tool calls the same way at every split of the text into deltas, and
never raise on malformed output (broken JSON, a cut-off channel, a recipient that is no client
function)."""

from __future__ import annotations

import pytest

from hearth.api.harmony import HarmonyReader
from hearth.api.harmony_prompt import render_harmony_prompt, resolve_chat_format
from hearth.api.protocol import APIError, ChatMessage, Tool
from hearth.server.output_parser import OutputParser, assemble_reasoning
from hearth.server.reasoning_parsers import make_reasoning_parser
from hearth.server.tool_grammar import tool_choice_guidance
from hearth.server.tool_parsers import ToolCall, assemble, make_tool_parser, tool_parser_for_template
from tests.unit.test_tool_parsers import make_ids

WEATHER = Tool.model_validate({"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "description": "The city's name"},
        "unit": {"type": "string", "enum": ["c", "f"], "default": "c"},
        "days": {"type": "array", "items": {"type": "integer"}}}}}})
CLOCK = Tool.model_validate({"type": "function", "function": {"name": "get_time"}})

CONVERSATION = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "reasoning_content": "Need the tool.",
     "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    {"role": "assistant", "content": "It is 21 C.", "reasoning_content": "Got it."},
]

EXPECTED_PROMPT = (
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    "Knowledge cutoff: 2024-06\nCurrent date: 2026-01-02\n\nReasoning: high\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message.\n"
    "Calls to these tools must go to the commentary channel: 'functions'.<|end|>"
    "<|start|>developer<|message|># Instructions\n\nAnswer briefly.\n\n# Tools\n\n"
    "## functions\n\nnamespace functions {\n\n"
    "// Current weather in a city.\n"
    "type get_weather = (_: {\n"
    "// The city's name\n"
    "city: string,\n"
    'unit?: "c" | "f", // default: "c"\n'
    "days?: number[],\n"
    "}) => any;\n\n"
    "type get_time = () => any;\n\n"
    "} // namespace functions<|end|>"
    "<|start|>user<|message|>Weather in Paris?<|end|>"
    "<|start|>assistant<|channel|>analysis<|message|>Need the tool.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city":"Paris"}<|call|>'
    "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"
    '{"temp": 21}<|end|>'
    "<|start|>assistant<|channel|>analysis<|message|>Got it.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>It is 21 C.<|end|>"
)


def messages(raw: list[dict]) -> list[ChatMessage]:
    return [ChatMessage.model_validate(m) for m in raw]


def test_renderer_writes_the_whole_conversation():
    prompt = render_harmony_prompt(messages(CONVERSATION), [WEATHER, CLOCK], add_generation_prompt=True,
                                   reasoning_effort="high", today="2026-01-02")
    assert prompt == EXPECTED_PROMPT + "<|start|>assistant"
    # no generation prompt: the last answer ends as the model ended it
    last = render_harmony_prompt(messages(CONVERSATION), [WEATHER, CLOCK], add_generation_prompt=False,
                                 reasoning_effort="high", today="2026-01-02")
    assert last == EXPECTED_PROMPT.removesuffix("<|end|>") + "<|return|>"


def test_renderer_drops_reasoning_of_finished_turns_and_defaults():
    raw = CONVERSATION + [{"role": "user", "content": "Thanks"}]
    prompt = render_harmony_prompt(messages(raw), None, today="2026-01-02")
    assert "Reasoning: medium" in prompt and "Calls to these tools" not in prompt
    assert "<|channel|>analysis" not in prompt  # both turns' reasoning dropped
    assert prompt.endswith("<|start|>user<|message|>Thanks<|end|><|start|>assistant")
    assert "# Tools" not in prompt and "# Instructions\n\nAnswer briefly.<|end|>" in prompt
    bare = render_harmony_prompt(messages([{"role": "user", "content": "hi"}]), None,
                                 today="2026-01-02", template_kwargs={"model_identity": "You are X."})
    assert bare == ("<|start|>system<|message|>You are X.\nKnowledge cutoff: 2024-06\n"
                    "Current date: 2026-01-02\n\nReasoning: medium\n\n# Valid channels: analysis, "
                    "commentary, final. Channel must be included for every message.<|end|>"
                    "<|start|>user<|message|>hi<|end|><|start|>assistant")


@pytest.mark.parametrize("raw, kwargs, param", [
    ([{"role": "tool", "tool_call_id": "nope", "content": "x"}], {}, "messages.0.tool_call_id"),
    ([{"role": "user", "content": "x"}], {"reasoning_effort": "max"}, "reasoning_effort"),
    ([{"role": "user", "content": "x"}], {"template_kwargs": {"enable_thinking": True}},
     "chat_template_kwargs"),
])
def test_renderer_refuses_what_it_cannot_write(raw, kwargs, param):
    with pytest.raises(APIError) as info:
        render_harmony_prompt(messages(raw), None, **kwargs)
    assert info.value.status == 400 and info.value.param == param


def test_chat_format_and_parser_from_the_template():
    harmony_template = "{{ '<|start|>' }}...{{ '<|channel|>' }}...{{ '<|call|>' }}"
    assert resolve_chat_format("auto", harmony_template) == "harmony"
    assert resolve_chat_format("auto", "{{ '<|im_start|>' }}") == "template"
    assert resolve_chat_format("harmony", None) == "harmony"
    assert tool_parser_for_template(harmony_template) == "openai"
    with pytest.raises(ValueError):
        resolve_chat_format("chatml", None)


ANALYSIS = "<|channel|>analysis<|message|>User wants weather. Call it.<|end|>"
CALL = ("<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "Paris"}<|call|>')
FINAL = "<|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>"
REASONING = "User wants weather. Call it."

# (output text, reasoning, content, calls [(name, arguments)], calls dropped)
CASES = [
    (ANALYSIS + CALL, REASONING, None, [("get_weather", '{"city": "Paris"}')], 0),
    (ANALYSIS + FINAL, REASONING, "It is sunny.", [], 0),
    ("<|channel|>final<|message|>Just an answer.", None, "Just an answer.", [], 0),
    # the recipient before the channel, no <|constrain|>, arguments with whitespace around
    ('<|channel|>analysis<|message|>x<|end|><|start|>assistant to=functions.get_time'
     '<|channel|>commentary json<|message|> \n{}\n<|call|>', "x", None, [("get_time", "{}")], 0),
    # a preamble to the user, then two calls, no end on the first (the next header ends it)
    ('<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>commentary '
     'to=functions.a<|message|>{"k": 1}<|start|>assistant<|channel|>commentary to=functions.b'
     '<|message|><|call|>', None, "Checking.", [("a", '{"k": 1}'), ("b", "{}")], 0),
    # malformed: broken JSON is reported as written
    (ANALYSIS + CALL.replace('{"city": "Paris"}', '{"city": Par'), REASONING, None,
     [("get_weather", '{"city": Par')], 0),
    # malformed: an analysis message cut off keeps its reasoning
    ("<|channel|>analysis<|message|>cut off mid", "cut off mid", None, [], 0),
    # malformed: a header cut off before <|message|>
    (ANALYSIS + "<|start|>assistant<|channel|>fin", REASONING, None, [], 1),
    # malformed: a built-in tool's recipient (no client function): dropped, not a call
    (ANALYSIS + '<|start|>assistant<|channel|>analysis to=browser.search<|message|>{"q": 1}'
     "<|call|>", REASONING, None, [], 1),
    # malformed: a header ended before its message; a call cut off (max_tokens)
    ("<|channel|>final<|end|><|start|>assistant<|channel|>commentary to=functions.f"
     '<|message|>{"a": [1', None, None, [("f", '{"a": [1')], 1),
    # no markup at all (a grammar-forced answer): content; stray markup dropped
    ('{"answer": 4}', None, '{"answer": 4}', [], 0),
    ("<|channel|>final<|message|>a<|message|>b<|constrain|>c<|end|>", None, "abc", [], 0),
    ("<", None, "<", [], 0),
    ("", None, None, [], 0),
]


def run(text_pieces: list[str], reasoning: bool = True) -> tuple:
    tools = make_tool_parser("openai", make_ids())
    parser = OutputParser(make_reasoning_parser("openai_gptoss") if reasoning else None, tools)
    events = []
    for piece in text_pieces:
        new = parser.feed(piece)
        assert all(not isinstance(e, str) or e for e in new)
        events += new
    events += parser.finish()
    content, calls = assemble([e for e in events if not hasattr(e, "text")])
    return assemble_reasoning(events), content, calls, tools.num_dropped


def expected(case: tuple) -> tuple:
    _, reasoning, content, calls, dropped = case
    return (reasoning, content, [ToolCall(f"call_{i}", n, a) for i, (n, a) in enumerate(calls)],
            dropped)


@pytest.mark.parametrize("case", CASES, ids=range(len(CASES)))
def test_every_split_parses_the_same(case):
    text = case[0]
    assert run([text]) == expected(case)
    for cut in range(len(text) + 1):
        assert run([text[:cut], text[cut:]]) == expected(case), cut
    for size in (1, 2, 3, 7):
        assert run([text[i:i + size] for i in range(0, len(text), size)]) == expected(case), size


def test_tool_parser_alone_drops_analysis():
    reasoning, content, calls, _ = run([ANALYSIS + FINAL], reasoning=False)
    assert (reasoning, content, calls) == (None, "It is sunny.", [])


def test_reasoning_offsets_cover_the_analysis_messages():
    parser = make_reasoning_parser("openai_gptoss")
    text = ANALYSIS + FINAL
    parser.feed(text)
    parser.finish()
    assert [parser.is_reasoning_at(i) for i in (0, len(ANALYSIS) - 1, len(ANALYSIS))] == [
        True, True, False]


def test_reader_offsets_add_up():
    reader = HarmonyReader()
    events = reader.feed(ANALYSIS + CALL) + reader.finish()
    ends = [e.offset for e in events if type(e).__name__ == "End"]
    assert ends == [len(ANALYSIS), len(ANALYSIS + CALL)]


def test_grammar_forces_harmony_calls():
    import json
    spec = tool_choice_guidance([WEATHER, CLOCK], "required", True, "openai")
    fmt = json.loads(spec.value)["format"]
    assert [e["begin"] for e in fmt["elements"]] == [
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>",
        "<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>"]
    assert {e["end"] for e in fmt["elements"]} == {"<|call|>"}
    auto = json.loads(tool_choice_guidance([WEATHER], "auto", False, "openai").value)["format"]
    assert auto["triggers"] == ["<|channel|>commentary to=functions."]


def test_server_parsers_under_the_harmony_format():
    from types import SimpleNamespace

    from hearth.server.worker_app import resolve_reasoning_parser, resolve_tool_parser
    chatml = SimpleNamespace(chat_template="{{ '<|im_start|>' }}")
    assert resolve_tool_parser("auto", chatml, "harmony") == "openai"
    assert resolve_tool_parser("auto", chatml, "template") == "hermes"
    assert resolve_reasoning_parser(None, "harmony") == "openai_gptoss"
    assert resolve_reasoning_parser("harmony", "harmony") == "harmony"
    assert resolve_reasoning_parser(None, "template") is None
    with pytest.raises(ValueError, match="cannot read the harmony"):
        resolve_reasoning_parser("qwen3", "harmony")
    with pytest.raises(ValueError, match="cannot read the harmony"):
        resolve_tool_parser("hermes", chatml, "harmony")
