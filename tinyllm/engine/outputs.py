"""What the engine hands back: vLLM's RequestOutput / CompletionOutput shapes."""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tinyllm.text.tool_calls import ToolCall

if TYPE_CHECKING:
    import torch


@dataclass
class TokenLogprob:
    """The chosen token's logprob under the model, and the top-n alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class CompletionOutput:
    index: int
    text: str  # everything safe to show so far (a possible stop-string start is held back)
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    stop_reason: str | int | None = None  # the stop string or token that ended it
    logprobs: list[TokenLogprob] | None = None
    # LLM.chat(tools=...): the calls parsed from `text` ([] for a text answer); else None.
    tool_calls: list[ToolCall] | None = None
    # LLM.chat on a thinking model: its thinking (the <think> part), which `text` then leaves
    # out ("" when it answered without thinking); None for other models and for generate.
    reasoning: str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    error: str | None = None  # why a request that could never run was refused
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    # With SamplingParams.prompt_logprobs: one per prompt token, None for the first (vLLM's).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # A pooling request's result (float32): its embedding, or a reranker's scores.
    pooled: "torch.Tensor | None" = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
