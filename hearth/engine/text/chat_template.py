"""Rendering a model's Jinja chat template the way transformers' `apply_chat_template` does.

Invariant: for the same template, messages, tools and flags, `render_chat_template` produces the
same string as transformers (same sandboxed environment options, same `tojson`, `raise_exception`
and `strftime_now` helpers, `{% generation %}` accepted), so prompts match the reference tokens.
Templates are untrusted input (they come with the checkpoint): they run in jinja2's immutable
sandbox, and any template error surfaces as `ChatTemplateError` (a ValueError: a 400 at the edge).
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import meta, nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Used when a checkpoint ships no template: ChatML, which most instruction-tuned models know.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatTemplateError(ValueError):
    """The template failed to render these messages (or raised on purpose via raise_exception)."""


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in some
    templates; for inference it renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja2's own tojson HTML-escapes and sorts keys; templates expect plain json.dumps.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def compile_chat_template(source: str) -> jinja2.Template:
    try:
        return _environment().from_string(source)
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"chat template does not compile: {e}") from e


def render_chat_template(
    template: jinja2.Template,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    special_tokens: dict[str, str | None] | None = None,
    **kwargs: Any,
) -> str:
    """Render; `special_tokens` ({"bos_token": "<s>", ...}) are visible to the template."""
    context = {**(special_tokens or {}), **kwargs}
    context.update(messages=messages, add_generation_prompt=add_generation_prompt)
    if tools is not None:
        context["tools"] = tools
    try:
        return template.render(**context)
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"chat template failed: {e}") from e
    except (TypeError, KeyError, AttributeError) as e:
        # e.g. the template concatenates message['content'] and got a list of parts
        raise ChatTemplateError(f"chat template failed on these messages: {e!r}") from e


def template_mentions_tools(source: str) -> bool:
    """Whether the template reads a `tools` variable (else the caller must inject tools itself)."""
    try:
        return "tools" in meta.find_undeclared_variables(_environment().parse(source))
    except jinja2.exceptions.TemplateError:
        return "tools" in source
