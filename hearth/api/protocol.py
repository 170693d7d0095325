"""OpenAI Chat Completions / Completions request models and the error type of the HTTP edge.

Requests are pydantic models in strict mode: unknown fields are ignored (clients send fields we
do not implement), a field of the wrong type is a 400 naming the field. Responses and stream
chunks are plain dicts built in `hearth.api.chat_chunks`, in exactly the shapes the OpenAI API
uses. Shared with the router, which parses the same requests.

Extensions beyond the OpenAI fields: `top_k`, `min_p`, `repetition_penalty`, `ignore_eos`,
`stop_token_ids`, `include_stop_str_in_output`, `skip_special_tokens`, `return_token_ids`, and
`kv_transfer` (reserved for prefill/decode disaggregation and resumed streams; documented in
docs/api.md and docs/pd_protocol.md).
"""

from __future__ import annotations

import secrets
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class APIError(Exception):
    """An error with an OpenAI-shaped body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def model_not_found(model: str) -> APIError:
    """OpenAI's answer to an unknown `model` (the SDK raises NotFoundError)."""
    return APIError(404, f"The model `{model}` does not exist or you do not have access to it.",
                    "invalid_request_error", None, "model_not_found")


# Integer ranges every field keeps, so a value always fits the typed messages to the engine
# (msgpack carries 64-bit integers) and the block hash (32-bit token ids).
Int64 = Annotated[int, Field(ge=-2**63, le=2**63 - 1)]  # OpenAI's own bound on `seed`
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]  # the vocabulary is checked by the worker
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 1024
MAX_TOP_LOGPROBS = 20


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


# ---- chat messages ---------------------------------------------------------------------------


class ContentPart(_Strict):
    type: str
    text: str | None = None


class FunctionCall(_Strict):
    name: str
    arguments: str = "{}"


class ToolCallIn(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    # an assistant turn's reasoning, as a response returned it; the chat template decides
    # whether it goes back into the prompt (the <think> templates drop it from past turns)
    reasoning_content: str | None = None


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"] = "function"
    function: NamedFunction


class JsonSchemaFormat(_Strict):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Strict):
    regex: str | None = None
    grammar: str | None = None


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


# ---- requests --------------------------------------------------------------------------------


class _SamplingFields(_Strict):
    """Fields both endpoints share; mapped onto SamplingParams in serving.py."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    # token id (as a string) -> bias in [-100, 100]; ids are checked against the vocabulary
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = Field(
        default=None, max_length=MAX_LOGIT_BIAS)
    # Extensions (vLLM / llama.cpp spellings).
    top_k: int | None = Field(default=None, ge=-1, le=2**31 - 1)
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM's: the prompt's and the output's token ids in the response (docs/pd_protocol.md)
    return_token_ids: bool = False
    # Prefill/decode hop spec (docs/pd_protocol.md); validated by hearth.api.pd_protocol.
    kv_transfer: dict[str, Any] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # wins over max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # low | medium | high: how long a reasoning model thinks (the harmony format's system
    # message says it; other formats ignore it)
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    # vLLM's extension: a regex or grammar (EBNF / Lark) the output must match
    structured_outputs: StructuredOutputs | None = None


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[TokenId], list[list[TokenId]]]
    max_tokens: int | None = 16  # the Completions API's own default
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)  # legacy: top logprobs per token
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    response_format: ResponseFormat | None = None


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    add_special_tokens: bool = False
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[TokenId]


def parse_request(model: type[BaseModel], payload: Any) -> Any:
    """Validate a decoded JSON body; a mismatch is a 400 naming the first offending field."""
    if not isinstance(payload, dict):
        raise bad_request("request body must be a JSON object")
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"] if not _is_type_tag(p)) or None
        raise bad_request(f"{param}: {first['msg']}" if param else first["msg"], param=param) from None


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _is_type_tag(loc_part: Any) -> bool:
    """Pydantic names the union member in an error's location ("prompt.list[int]"); drop it."""
    return isinstance(loc_part, str) and ("[" in loc_part or loc_part in _TYPE_TAGS
                                          or loc_part.startswith(("function-", "literal")))


def new_id(prefix: str) -> str:
    """A response/completion id: `prefix-` and 24 random hex digits."""
    return f"{prefix}-{secrets.token_hex(12)}"
