"""The chat path every dialect shares: one internal chat request (OpenAI's chat body, which
/v1/responses, /v1/messages and /api/chat translate into) becomes engine requests, and each
choice's text becomes content, reasoning and tool-call deltas (tinyllm.text.answer).

A dialect builds a `ChatCompletionRequest`, calls `ChatServing.start` (which raises APIError
for anything wrong with it before the engine sees it), then either iterates `ChatRun.deltas()`
to stream or awaits `ChatRun.finish()` and reads `ChatRun.answers`; either way it closes the run,
which aborts what is left in the engine.
"""

import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from starlette.concurrency import run_in_threadpool

from tinyllm.engine.outputs import TokenLogprob
from tinyllm.engine.structured_output.params import StructuredOutputsParams
from tinyllm.entrypoints.llm import LLM
from tinyllm.entrypoints.server.engine_loop import EngineLoop
from tinyllm.entrypoints.server.engine_requests import (
    Choice,
    Constraint,
    Prompt,
    chat_prompt,
    plan_choices,
    request_constraint,
)
from tinyllm.entrypoints.server.errors import APIError
from tinyllm.entrypoints.server.generation import Generation
from tinyllm.entrypoints.server.protocol import (
    ChatCompletionRequest,
    CompletionTokensDetails,
    SamplingRequest,
    Usage,
)
from tinyllm.entrypoints.server.tools import ToolPlan, finish_reason, plan_tools
from tinyllm.text import harmony
from tinyllm.text.answer import Answer, AnswerDelta, AnswerStream
from tinyllm.text.harmony import HarmonySplit
from tinyllm.text.reasoning import (
    ReasoningFormat,
    ThinkingState,
    ThinkSplit,
    plan_thinking,
    template_kwargs,
)
from tinyllm.text.reasoning_grammar import harmony_grammar, thinking_grammar
from tinyllm.text.tool_calls import CallDelta

log = logging.getLogger("tinyllm.server")


@dataclass
class ChatDelta:
    """What is new in choice `index`: the answer's parts, its tokens' logprobs, and its finish
    reason on the last one ("stop", "length", "tool_calls", "abort")."""

    index: int
    content: str = ""
    reasoning: str = ""
    calls: list[CallDelta] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None


@dataclass
class Thinking:
    """How a request's answers think: the model's format, where each answer starts, whether
    the response shows the thinking (vLLM's include_reasoning), the end tag's token id."""

    fmt: ReasoningFormat
    state: ThinkingState
    include: bool = True
    end_id: int | None = None


@dataclass
class ChatAnswer(Answer):
    """A choice's whole answer."""

    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None


class ChatServing:
    """Turns internal chat requests into running `ChatRun`s."""

    def __init__(self, llm: LLM, engine_loop: EngineLoop) -> None:
        self.tokenizer, self.model_name = llm.tokenizer, llm.model_name
        self.loop = engine_loop  # the engine itself only its thread touches
        self.validator = llm.engine.request_validator()
        # A field a request leaves out: the model's recommended value (--generation-config
        # auto), else OpenAI's defaults, which SamplingParams' neutral values are.
        self.defaults = llm.get_default_sampling_params()
        self.default_max_tokens = llm.default_sampling.get("max_tokens")
        self.reasoning, self.reasoning_budget = llm.reasoning, llm.reasoning_budget
        self.tool_format = llm.tool_format
        self.harmony = self.reasoning is not None and self.reasoning.harmony

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                404,
                f"The model `{model}` does not exist; this server serves `{self.model_name}`.",
                param="model",
                code="model_not_found",
            )

    def check_fields(self, req: SamplingRequest) -> None:
        """The checks every request shares: the model, and a log line for ignored fields."""
        self.check_model(req.model)
        if ignored := req.ignored_fields():
            log.warning("ignoring unsupported request fields: %s", ", ".join(ignored))

    async def start(self, req: ChatCompletionRequest, request_id: str | None = None) -> "ChatRun":
        self.check_fields(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        max_tokens, param = req.max_completion_tokens, "max_completion_tokens"
        if max_tokens is None:
            max_tokens, param = req.max_tokens, "max_tokens"
        request_id = request_id or f"chatcmpl-{uuid.uuid4().hex}"
        prompt, tools, thinking, constraint = await self.render(req)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        choices = plan_choices(
            self.validator,
            request_id,
            req,
            [prompt],
            max_tokens,
            self.default_max_tokens,
            logprobs,
            self.defaults,
            param,
            constraint,
        )
        if self.harmony:
            for c in choices:
                c.params = harmony.keep_markers(c.params, self.tokenizer.token_to_id)
        return ChatRun(Generation(self.loop, request_id, [prompt], choices), tools, thinking)

    async def render(
        self, req: ChatCompletionRequest
    ) -> tuple[Prompt, ToolPlan, "Thinking | None", Constraint | None]:
        """The request's prompt, tools, thinking and constraint, as `start` runs them (and
        token counting endpoints count them)."""
        constraint = request_constraint(req)
        tools = plan_tools(
            req, constraint is not None, self.tool_format, self.tokenizer.added_tokens
        )
        if tools.constraint is not None:
            constraint = Constraint(tools.constraint, "tools")
        kwargs = template_kwargs(
            self.tokenizer.chat_template,
            req.enable_thinking,
            req.chat_template_kwargs,
            req.reasoning_effort,
        )
        try:
            self.tokenizer.check_template_kwargs(kwargs)
        except ValueError as e:
            raise APIError(400, str(e), param="chat_template_kwargs") from e
        prompt = await run_in_threadpool(
            chat_prompt,
            self.tokenizer,
            req.messages,
            tools=tools.tools,
            template_kwargs=kwargs,
            tool_format=tools.format,
        )
        thinking, constraint, prompt = self._plan_thinking(req, prompt, constraint)
        return prompt, tools, thinking, constraint

    def _plan_thinking(
        self, req: ChatCompletionRequest, prompt: Prompt, constraint: Constraint | None
    ) -> tuple[Thinking | None, Constraint | None, Prompt]:
        """Where the answers start (thinking turned off in the prompt where the template has no
        switch), and the constraint that lets the model think first: a response_format or tool
        grammar, and the thinking budget, apply from the end of the thinking on."""
        fmt = self.reasoning
        if fmt is None:
            return None, constraint, prompt
        suffix, state = plan_thinking(fmt, prompt.text or "", req.enable_thinking)
        if suffix:
            ids = prompt.token_ids + self.tokenizer.encode(suffix, add_special_tokens=False)
            prompt = Prompt(ids, (prompt.text or "") + suffix)
        budget = req.thinking_token_budget
        if budget is None:
            budget = self.reasoning_budget
        end_id = self.tokenizer.token_to_id(fmt.end)
        thinking = Thinking(fmt, state, req.include_reasoning, end_id)
        tools = constraint is not None and constraint.where == "tools"
        if (constraint is None and budget is None) or (
            state == "closed" and (tools or not fmt.harmony)
        ):
            return thinking, constraint, prompt
        answer = None
        where = "thinking_token_budget"
        if constraint is not None:
            where = constraint.where
            fields = dataclasses.asdict(constraint.params).items()
            answer = {k: v for k, v in fields if v not in (None, False)}
        try:
            if fmt.harmony:  # the answer is in messages of its own, the tool grammar's or one
                closed = state == "closed"
                grammar = harmony_grammar(self.tokenizer, closed, answer, budget, tools)
            else:
                grammar = thinking_grammar(self.tokenizer, fmt, state, answer, budget)
        except ValueError as e:  # a schema given as text that is not JSON
            raise APIError(400, f"{where}: {e}", param=where.split(".")[0]) from e
        return thinking, Constraint(StructuredOutputsParams(grammar=grammar), where), prompt


class ChatRun:
    """One chat request running in the engine: its choices' deltas as they come, or their
    whole answers once done."""

    def __init__(self, gen: Generation, tools: ToolPlan, thinking: Thinking | None = None) -> None:
        self.gen, self.request_id = gen, gen.request_id
        self.choices: list[Choice] = gen.choices
        self.thinking = thinking
        self._splits = {c.index: _split(thinking) for c in self.choices}
        self._streams = {
            c.index: AnswerStream(self._splits[c.index], tools.format if tools.parse else None)
            for c in self.choices
        }
        self.answers = {c.index: ChatAnswer() for c in self.choices}

    def _delta(self, choice: Choice, text: str, reason: str | None) -> ChatDelta:
        stream = self._streams[choice.index]
        new: AnswerDelta = stream.feed(text, reason is not None, cut=reason == "length")
        if self.thinking is not None and not self.thinking.include:
            new.reasoning = ""
        reason = finish_reason(reason, stream.has_calls, stream.calls_complete)
        delta = ChatDelta(choice.index, new.content, new.reasoning, new.calls, None, reason)
        answer = self.answers[choice.index]
        answer.add(new)
        answer.finish_reason = reason
        return delta

    async def deltas(self) -> AsyncIterator[ChatDelta]:
        """Each choice's news, in order; a choice's last delta has its finish reason. Tokens
        whose text is still held back (a stop string may be starting) send their logprobs with
        the next delta that has text. Raises APIError if the engine fails the request."""
        held: dict[int, list[TokenLogprob]] = {}
        async for batch in self.gen.updates():
            for choice, out in batch:
                lps = out.logprobs
                if lps is not None:
                    lps = held.pop(choice.index, []) + lps
                delta = self._delta(choice, out.text, out.finish_reason)
                delta.logprobs = lps
                self._add_logprobs(choice.index, out.logprobs)
                news = delta.content or delta.reasoning or delta.calls
                if not news and delta.finish_reason is None:
                    if lps:
                        held[choice.index] = lps
                    continue
                yield delta

    async def finish(
        self,
        disconnected: Callable[[], Awaitable[bool]],
        on_output: Callable[[], None] | None = None,
    ) -> bool:
        """Run every choice to its end; False if the client went away first. `on_output` runs
        as outputs arrive."""
        if not await self.gen.finish(disconnected, on_output):
            return False
        for c in self.choices:
            result = self.gen.results[c.index]
            self._delta(c, result.text, result.finish_reason)
            self.answers[c.index].logprobs = result.logprobs
        return True

    def _add_logprobs(self, index: int, lps: list[TokenLogprob] | None) -> None:
        if lps is not None:
            answer = self.answers[index]
            answer.logprobs = (answer.logprobs or []) + lps

    def usage(self) -> Usage:
        """Token counts; for a thinking model, also how many of the completion's were thinking."""
        usage = self.gen.usage()
        if self.thinking is not None:
            results, end_id = self.gen.results, self.thinking.end_id
            thought = sum(
                split.reasoning_tokens(results[i].token_ids, end_id)
                for i, split in self._splits.items()
                if split is not None
            )
            usage.completion_tokens_details = CompletionTokensDetails(reasoning_tokens=thought)
        return usage

    def close(self) -> None:
        self.gen.close()


def _split(thinking: Thinking | None) -> ThinkSplit | HarmonySplit | None:
    """An answer's splitter into reasoning and the rest."""
    if thinking is None:
        return None
    if thinking.fmt.harmony:
        return HarmonySplit()
    return ThinkSplit(thinking.fmt, thinking.state)
