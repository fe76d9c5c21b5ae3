"""The OpenAI API's request and response bodies, the subset tinyllm serves, as pydantic models.

Optional parameters accept `null` as "the default", as OpenAI's API does.
"""

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

TokenIds = list[int]
# A few stop strings are all anyone needs, and each one costs the engine work on every token.
MAX_STOP_STRINGS = 16


def _stop_limit(stop: str | list[str]) -> str | list[str]:
    # Checked on the union as a whole: a limit inside one member reads "stop.str: Input should
    # be a valid string" for a list that is too long.
    if isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, not {len(stop)}")
    return stop


StopStrings = Annotated[str | list[str], AfterValidator(_stop_limit)]


def _omitted_if_none() -> Any:
    """A response field left out of the JSON when it is None (OpenAI omits it)."""
    return Field(None, exclude_if=lambda v: v is None)


class _Request(BaseModel):
    # strict: "16" is not a number and 1.5 is not a token count. Unknown fields are kept (not
    # refused, clients send many) so the server can log which ones it ignored.
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


class StreamOptions(_Request):
    include_usage: bool | None = None


class JsonSchemaFormat(_Request):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    # "schema" would shadow pydantic's own BaseModel.schema.
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Request):
    """vLLM's `structured_outputs` field: exactly one of these."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class SamplingRequest(_Request):
    model: str | None = None
    n: int | None = Field(None, ge=1, le=128)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: StopStrings | None = None
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
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None


class CompletionRequest(SamplingRequest):
    # One prompt (text or token ids) or a batch of them.
    prompt: str | TokenIds | list[str] | list[TokenIds]
    max_tokens: int | None = None
    logprobs: int | None = None
    echo: bool | None = None


class ContentPart(_Request):
    type: str
    text: str | None = None


class FunctionCall(_Request):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Request):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # role "tool": the call it answers


class FunctionDefinition(_Request):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: no arguments
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    # Every tool is rendered into the prompt, so a few hundred is already more than any model
    # can use.
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    # Off unless asked for (llama.cpp's default; OpenAI's is on): a small model allowed several
    # calls tends to repeat its call until max_tokens cuts one.
    parallel_tool_calls: bool | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # Variables for the chat template, as vLLM takes them (Qwen3's {"enable_thinking": false}).
    chat_template_kwargs: dict[str, Any] | None = None
    # A thinking model's switch, mapped onto its template's (enable_thinking): what Ollama's
    # `think`, Anthropic's `thinking` and Responses' `reasoning.effort` become. None: the model's
    # default.
    enable_thinking: bool | None = None
    # The most tokens a thinking model may think before it answers (vLLM's name); None: the
    # server's --reasoning-budget.
    thinking_token_budget: int | None = Field(None, ge=0)
    # vLLM's: false leaves the thinking out of the response.
    include_reasoning: bool = True


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None  # with messages: rendered as chat completions would
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: TokenIds


# -- responses ----------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose K/V came from the prefix cache


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int  # a thinking model's tokens before its answer, the tags included


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    # Only for a thinking model's answers.
    completion_tokens_details: CompletionTokensDetails | None = _omitted_if_none()


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


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    # A thinking model's reasoning, apart from the content: clients read either name.
    reasoning_content: str | None = _omitted_if_none()
    reasoning: str | None = _omitted_if_none()
    tool_calls: list[ToolCallOut] | None = _omitted_if_none()


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


class FunctionDelta(BaseModel):
    name: str | None = _omitted_if_none()
    arguments: str


class ToolCallDelta(BaseModel):
    """OpenAI's streamed call: index, id, type and name in its first delta, then arguments."""

    index: int
    id: str | None = _omitted_if_none()
    type: Literal["function"] | None = _omitted_if_none()
    function: FunctionDelta


class Delta(BaseModel):
    role: str | None = _omitted_if_none()
    content: str | None = _omitted_if_none()
    reasoning_content: str | None = _omitted_if_none()
    reasoning: str | None = _omitted_if_none()
    tool_calls: list[ToolCallDelta] | None = _omitted_if_none()


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
