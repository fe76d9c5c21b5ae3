"""The OpenAI API's request and response bodies, the subset tinyllm serves, as pydantic models.

Optional parameters accept `null` as "the default", as OpenAI's API does.
"""

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

TokenIds = list[int]
# A few stop strings are all anyone needs, and each one costs the engine work on every token.
StopStrings = Annotated[list[str], Field(max_length=16)]


class _Request(BaseModel):
    # strict: "16" is not a number and 1.5 is not a token count. Unknown fields are kept (not
    # refused, clients send many) so the server can log which ones it ignored.
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


class StreamOptions(_Request):
    include_usage: bool | None = None


class SamplingRequest(_Request):
    model: str | None = None
    n: int | None = Field(None, ge=1, le=128)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: str | StopStrings | None = None
    stop_token_ids: TokenIds | None = None
    # Signed 64 bits, what torch.Generator takes (choice i of n draws from seed + i, wrapped).
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    # OpenAI's limit; every entry costs the engine work on every token.
    logit_bias: Annotated[dict[str, float], Field(max_length=300)] | None = None
    user: str | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None


class CompletionRequest(SamplingRequest):
    # One prompt (text or token ids) or a batch of them.
    prompt: str | TokenIds | list[str] | list[TokenIds]
    max_tokens: int | None = None
    logprobs: int | None = None
    echo: bool | None = None


class ContentPart(_Request):
    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: TokenIds


# -- responses ----------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose K/V came from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    # null for an echoed prompt's first token (nothing before it to predict it)
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: str | None = Field(None, exclude_if=lambda v: v is None)
    content: str | None = Field(None, exclude_if=lambda v: v is None)


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tinyllm"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


def error_body(message: str, type_: str, param: str | None, code: str | None) -> dict[str, Any]:
    info = ErrorInfo(message=message, type=type_, param=param, code=code)
    return ErrorResponse(error=info).model_dump()
