"""Ollama's native API (/api/chat, /api/generate, /api/show): the request bodies tinyllm
reads, as pydantic models. Responses are plain dicts built in ollama.py."""

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    # Unknown fields are kept so they can be logged as ignored; Ollama's clients send several.
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


class Options(_Body):
    """The `options` tinyllm honours; any other is logged and ignored (as Ollama does)."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    stop: list[str] | None = None
    num_predict: int | None = None  # -1 or -2: until the context is full
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    num_ctx: int | None = Field(None, ge=1)


class CallFunction(_Body):
    name: str
    arguments: dict[str, Any] = {}  # an object, not JSON text (unlike OpenAI)


class ToolCall(_Body):
    function: CallFunction


class Message(_Body):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    thinking: str | None = None  # an assistant's earlier thinking: not sent back to the model
    images: list[str] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None  # role "tool": the function whose result this is


# "json", or a JSON schema the answer must follow; "" is what some clients send for none.
Format = Literal["json", ""] | dict[str, Any]
Think = bool | Literal["low", "medium", "high"]


class _Generating(_Body):
    model: str
    format: Format | None = None
    options: Options | None = None
    stream: bool = True
    keep_alive: str | int | float | None = None  # accepted: the one model stays loaded
    think: Think | None = None


class ChatRequest(_Generating):
    messages: list[Message] = []
    tools: list[dict[str, Any]] | None = None  # OpenAI-shaped function tools


class GenerateRequest(_Generating):
    prompt: str = ""
    system: str | None = None
    suffix: str | None = None
    template: str | None = None
    raw: bool = False
    context: list[int] | None = None
    images: list[str] | None = None


class ShowRequest(_Body):
    model: str | None = None
    name: str | None = None  # the older clients' name for `model`
    verbose: bool | None = None
