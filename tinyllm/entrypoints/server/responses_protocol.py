"""OpenAI's Responses API (/v1/responses): the request, its input items and tools, and the
response object with its output items, as pydantic models (the subset tinyllm serves).

Field names follow the official SDK's `openai.types.responses`; optional fields accept `null`.
"""

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _In(BaseModel):
    # strict: "16" is not a number. Unknown fields are kept (clients send many) so the server
    # can log the ones it ignores at the top level; inside items they are ignored.
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


# -- request ------------------------------------------------------------------------------------


class TextConfig(_In):
    format: dict[str, Any] | None = None  # text / json_object / json_schema, checked on use
    verbosity: str | None = None


class ResponsesRequest(_In):
    model: str | None = None
    input: str | list[dict[str, Any]] | None = None  # items are checked one by one (input.N)
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = Field(None, max_length=128)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: str | None = None
    include: list[str] | None = None


class TextPart(_In):
    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(_In):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[dict[str, Any]]  # parts are checked one by one (content.N)


class FunctionCallItem(_In):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text, as the model wrote it


class FunctionCallOutputItem(_In):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[dict[str, Any]]


class ReasoningItem(_In):
    """An earlier answer's reasoning, passed back; chat templates drop past thinking."""

    type: Literal["reasoning"]


class FunctionTool(_In):
    """Responses' flat function tool (chat completions nests it under `function`)."""

    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


# -- response -----------------------------------------------------------------------------------


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str = ""
    annotations: list[Any] = []
    logprobs: list[Any] = []


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str = ""


Status = Literal["in_progress", "completed", "incomplete"]


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Status = "in_progress"
    content: list[OutputText] = []


class OutputFunctionCall(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str = ""
    status: Status = "in_progress"


class OutputReasoning(BaseModel):
    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = []
    content: list[ReasoningText] = []
    status: Status = "in_progress"


OutputItem = OutputMessage | OutputFunctionCall | OutputReasoning


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    cache_write_tokens: int = 0  # OpenAI's explicit cache writes: the prefix cache needs none


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    """The response, with the request's settings echoed as OpenAI echoes them."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    completed_at: int | None = None
    model: str
    status: Literal["in_progress", "completed", "incomplete", "failed"] = "in_progress"
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    output: list[OutputItem] = []
    usage: ResponseUsage | None = None
    instructions: str | None = None
    tools: list[dict[str, Any]] = []
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = False
    text: dict[str, Any] = {"format": {"type": "text"}}
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, str] = {}
    truncation: str = "disabled"
    store: bool = True
    user: str | None = None
    background: bool = False
    # Clients read it whether or not the server sends it (pydantic-ai); null: no diagnostics.
    prompt_cache_diagnostics: dict[str, Any] | None = None


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True
