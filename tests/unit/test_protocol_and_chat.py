"""Request validation (400s naming the field) and chat prompt rendering, with no model."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

from hearth.engine.text.tokenizer import Tokenizer
from hearth.api.chat_prompt import render_chat_prompt, tool_section
from hearth.api.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ChatMessage,
    Tool,
    parse_request,
)
from hearth.server.tool_grammar import tool_choice_guidance
from hearth.server.tool_parsers import assemble, make_tool_parser

USER = {"role": "user", "content": "hi"}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def make_tokenizer(chat_template: str | None = None) -> Tokenizer:
    backend = HFTokenizer(models.WordLevel({"<unk>": 0, "hi": 1}, unk_token="<unk>"))
    return Tokenizer(backend, chat_template=chat_template)


def error_of(model, payload) -> APIError:
    with pytest.raises(APIError) as info:
        parse_request(model, payload)
    assert info.value.status == 400
    return info.value


def test_unknown_fields_are_ignored_and_types_are_strict():
    request = parse_request(ChatCompletionRequest, {"messages": [USER], "whatever": {"a": 1},
                                                    "temperature": 0, "stop": "x"})
    assert request.temperature == 0.0 and request.stop == "x"
    assert error_of(ChatCompletionRequest, {"messages": [USER], "max_tokens": "5"}).param == "max_tokens"
    assert error_of(ChatCompletionRequest, {"messages": [USER], "n": 1.5}).param == "n"
    assert error_of(ChatCompletionRequest, {"messages": []}).param == "messages"
    assert error_of(ChatCompletionRequest, {"messages": [{"role": "robot", "content": "x"}]}).param \
        == "messages.0.role"
    assert error_of(CompletionRequest, {"prompt": 5}).param == "prompt"
    assert error_of(ChatCompletionRequest, [1, 2]).param is None


def test_error_body_has_the_openai_shape():
    body = error_of(ChatCompletionRequest, {"messages": [USER], "logprobs": "yes"}).body()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["param"] == "logprobs"


def test_template_without_tools_gets_the_hermes_section_and_history():
    tokenizer = make_tokenizer()  # ChatML fallback: no tools in the template
    messages = [ChatMessage.model_validate(m) for m in [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather"}, {"type": "text", "text": "in Oslo?"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "rain"},
        {"role": "tool", "tool_call_id": "c2", "content": "wind"},
    ]]
    tools = [Tool.model_validate(WEATHER_TOOL)]
    prompt = render_chat_prompt(tokenizer, messages, tools)
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\n" + tool_section(tools))
    assert '"name": "get_weather"' in prompt and "<tools>" in prompt
    assert "<|im_start|>user\nWeather\nin Oslo?<|im_end|>" in prompt
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n' \
           "</tool_call><|im_end|>" in prompt
    assert "<|im_start|>user\n<tool_response>\nrain\n</tool_response>\n<tool_response>\nwind\n" \
           "</tool_response><|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_template_with_tools_receives_them_and_argument_objects():
    template = ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
                "{% for m in messages %}{{ m.role }}:{{ m.content }}"
                "{% for c in m.tool_calls or [] %}<{{ c.function.arguments | tojson }}>{% endfor %};"
                "{% endfor %}")
    tokenizer = make_tokenizer(template)
    assert tokenizer.supports_tools_in_template
    messages = [ChatMessage.model_validate(m) for m in [USER, {
        "role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": '{"a": 1}'}}]}]]
    prompt = render_chat_prompt(tokenizer, messages, [Tool.model_validate(WEATHER_TOOL)])
    assert prompt == '[get_weather]user:hi;assistant:<{"a": 1}>;'


def test_non_text_content_part_is_400():
    message = ChatMessage.model_validate({"role": "user", "content": [{"type": "image_url"}]})
    with pytest.raises(APIError) as info:
        render_chat_prompt(make_tokenizer(), [message], None)
    assert info.value.param == "messages.0.content.0.type"


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_tool_grammar_text_is_what_the_parser_reads(parser):
    """The forced-call format the grammar allows parses back into exactly that call."""
    tools = [Tool.model_validate(WEATHER_TOOL)]
    spec = tool_choice_guidance(tools, "required", True, parser)
    tag = json.loads(spec.value)["format"]["elements"][0]
    text = tag["begin"] + '{"city": "Oslo"}' + tag["end"]
    parser_obj = make_tool_parser(parser)
    content, calls = assemble(parser_obj.feed(text) + parser_obj.finish())
    assert content is None and [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Oslo"}')]


def test_tool_choice_errors():
    tools = [Tool.model_validate(WEATHER_TOOL)]
    with pytest.raises(APIError, match="not in tools"):
        tool_choice_guidance(tools, parse_request(ChatCompletionRequest, {
            "messages": [USER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}).tool_choice,
            True, "hermes")
    assert tool_choice_guidance(tools, "none", True, "hermes") is None
