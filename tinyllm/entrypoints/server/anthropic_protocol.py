"""Anthropic's Messages API request and response bodies, the subset tinyllm serves, as pydantic
models. Content blocks are read loosely here (one model for every block type) and checked type by
type in the translation (anthropic.py), so an unserved block is a 400 that names it and its index.
"""

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tinyllm.entrypoints.server.protocol import MAX_STOP_STRINGS


class _Body(BaseModel):
    # strict: "16" is not a number. Unknown fields (cache_control, citations, service_tier...)
    # are kept, not refused: Anthropic's clients send many.
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


class TextBlock(_Body):
    type: Literal["text"]
    text: str


class Block(_Body):
    """Any content block; which fields it needs depends on its type."""

    type: str
    text: str | None = None  # text
    id: str | None = None  # tool_use
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None  # tool_result
    content: "str | list[Block] | None" = None
    is_error: bool | None = None
    thinking: str | None = None  # thinking
    signature: str | None = None


class MessageParam(_Body):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class ToolParam(_Body):
    type: str | None = None  # None or "custom": a client tool; anything else a server tool
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any] | None = None


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # type "tool"
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(_Body):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1)


class OutputFormat(_Body):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")  # "schema" would shadow BaseModel.schema


class OutputConfig(_Body):
    format: OutputFormat | None = None
    effort: str | None = None  # accepted, not used


class CountTokensRequest(_Body):
    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolParam] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = Field(None, max_length=MAX_STOP_STRINGS)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None
    stream: bool | None = None


# -- responses ----------------------------------------------------------------------------------


class TextOut(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingOut(BaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str


class ToolUseOut(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class MessageUsage(BaseModel):
    # input_tokens are the prompt tokens not read from the cache, as Anthropic counts them.
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ThinkingOut | TextOut | ToolUseOut]
    stop_reason: str | None = None
    stop_sequence: str | None = None
    usage: MessageUsage


def error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error shape for an HTTP status."""
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


_ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
