"""The OpenAI API's request and response bodies, the subset tinyllm serves, as pydantic models.

Optional parameters accept `null` as "the default", as OpenAI's API does.
"""

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr, model_validator

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

    def ignored_fields(self) -> list[str]:
        """The fields this request carries that nothing reads, as dotted paths
        ("response_format.json_schema.foo", "messages.2.bar"): its own and those inside the
        objects it holds, for the server to log."""
        found = list(self.model_extra or ())
        for name in type(self).model_fields:
            found += _ignored_in(getattr(self, name), name)
        return found


def _ignored_in(value: Any, path: str) -> list[str]:
    if isinstance(value, _Request):
        return [f"{path}.{field}" for field in value.ignored_fields()]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _ignored_in(v, f"{path}.{i}")]
    return []


class StreamOptions(_Request):
    include_usage: bool | None = None


class JsonSchemaFormat(_Request):
    # OpenAI requires a name; clients written for llama.cpp or vLLM leave it out.
    name: str | None = Field(None, min_length=1, max_length=64)
    description: str | None = None
    # "schema" would shadow pydantic's own BaseModel.schema.
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    # Not OpenAI's: a schema beside the type, as Together's and Fireworks' APIs take it with
    # json_object (and clients written for them send it); llama.cpp and vLLM honour it too.
    schema_: dict[str, Any] | None = Field(None, alias="schema")


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
    # The legacy functions API: an assistant's earlier call (role "function" answers it, with
    # the function's name). ChatCompletionRequest reads both as tool calls and tool messages.
    function_call: FunctionCall | None = None
    # Response fields the openai SDK keeps when a client sends an earlier answer back: read and
    # ignored, not logged as unknown.
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: Any = None


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
    # How hard to think (OpenAI's field), for a template that reads it (gpt-oss's: low,
    # medium or high); Responses' `reasoning.effort` becomes it too.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    # The most tokens a thinking model may think before it answers (vLLM's name); None: the
    # server's --reasoning-budget.
    thinking_token_budget: int | None = Field(None, ge=0)
    # vLLM's: false leaves the thinking out of the response.
    include_reasoning: bool = True
    # The legacy functions API (OpenAI's before tools, which older clients still send): read
    # as `tools` and `tool_choice` with one call at most; `legacy_functions` says it was used.
    functions: Annotated[list[FunctionDefinition], Field(max_length=128)] | None = None
    function_call: Literal["none", "auto"] | FunctionName | None = None
    _legacy_functions: bool = PrivateAttr(False)

    @property
    def legacy_functions(self) -> bool:
        """Whether the request used the legacy functions API, whose answer names its call in
        `message.function_call` rather than `tool_calls`."""
        return self._legacy_functions

    def ignored_fields(self) -> list[str]:
        found = super().ignored_fields()
        if self._legacy_functions:  # its tools are its functions: named once, as sent
            found = [f for f in found if not f.startswith("tools.")]
        return found

    @model_validator(mode="after")
    def _functions_as_tools(self) -> "ChatCompletionRequest":
        if any(m.function_call is not None or m.role == "function" for m in self.messages):
            self.messages = _legacy_messages_as_tool_messages(self.messages)
        if self.functions is None and self.function_call is None:
            return self
        if self.tools is not None or self.tool_choice is not None:
            raise ValueError("give functions and function_call, or tools and tool_choice, not both")
        self._legacy_functions = True
        self.parallel_tool_calls = False  # the legacy API answers with one call at most
        choice = self.function_call
        if not self.functions:
            if isinstance(choice, FunctionName):
                raise ValueError(f"function_call names {choice.name!r}, but no functions are given")
            return self  # "none" or "auto" with nothing to call: a plain chat
        self.tools = [Tool(type="function", function=f) for f in self.functions]
        if isinstance(choice, FunctionName):
            self.tool_choice = NamedToolChoice(type="function", function=choice)
        else:
            self.tool_choice = choice
        return self


def _legacy_messages_as_tool_messages(messages: list[ChatMessage]) -> list[ChatMessage]:
    """An assistant's `function_call` as its one tool call, and a role "function" message as
    the "tool" message answering the latest call of that name (legacy calls carry no ids)."""
    out, call_ids = [], {}
    for i, m in enumerate(messages):
        if m.function_call is not None:
            call_ids[m.function_call.name] = f"call_{i}"
            call = ToolCall(id=f"call_{i}", function=m.function_call)
            m = m.model_copy(update={"function_call": None, "tool_calls": [call]})
        elif m.role == "function":
            update = {"role": "tool", "tool_call_id": call_ids.get(m.name or "", f"call_{i}")}
            m = m.model_copy(update=update)
        out.append(m)
    return out


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
    function_call: FunctionCallOut | None = _omitted_if_none()  # the legacy functions API's


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
    function_call: FunctionDelta | None = _omitted_if_none()  # the legacy functions API's


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
