"""Tool calling on /v1/chat/completions: the request's tools and tool_choice into a prompt and a
grammar; the answer's `<tool_call>` blocks into OpenAI's `tool_calls`, whole or streamed."""

import re
from dataclasses import dataclass
from typing import Any

from tinyllm.engine.structured_output.params import StructuredOutputsParams
from tinyllm.entrypoints.server.errors import APIError
from tinyllm.entrypoints.server.protocol import (
    AssistantMessage,
    ChatCompletionRequest,
    Delta,
    FunctionCallOut,
    FunctionDelta,
    ToolCallDelta,
    ToolCallOut,
)
from tinyllm.text.tool_calls import ToolCallStream, parse_tool_calls
from tinyllm.text.tool_grammar import tool_choice_grammar


@dataclass
class ToolPlan:
    tools: list[dict[str, Any]] | None  # for the chat template
    constraint: StructuredOutputsParams | None  # None: tools are not what constrains the answer
    parse: bool  # whether answers are parsed for calls


def plan_tools(req: ChatCompletionRequest, constrained: bool) -> ToolPlan:
    """`constrained`: the request has its own response_format or structured_outputs, which
    only tool_choice none leaves room for (an answer cannot be both a call and that JSON)."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return ToolPlan(None, None, False)
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    if choice is None:
        choice = "auto"
    elif not isinstance(choice, str):
        choice = choice.model_dump()
    try:
        grammar = tool_choice_grammar(tools, choice, bool(req.parallel_tool_calls))
    except ValueError as e:  # "tools.1.function.parameters (f): ..." or "tool_choice: ..."
        raise APIError(400, str(e), param=re.match(r"\w+", str(e)).group()) from e
    if choice == "none":
        # Rendered for the model to know, never called.
        return ToolPlan(
            tools, None if constrained else StructuredOutputsParams(grammar=grammar), False
        )
    if constrained:
        raise APIError(
            400,
            "response_format or structured_outputs with tools: give tool_choice none, or drop one",
            param="tool_choice",
        )
    return ToolPlan(tools, StructuredOutputsParams(grammar=grammar), True)


def finish_reason(reason: str | None, has_calls: bool) -> str | None:
    return "tool_calls" if has_calls and reason == "stop" else reason


def tool_message(text: str, reason: str | None) -> tuple[AssistantMessage, str | None]:
    """The whole answer as a message with its calls, and its finish reason."""
    parsed = parse_tool_calls(text)
    if not parsed.calls:
        return AssistantMessage(content=text), reason
    calls = [
        ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments))
        for c in parsed.calls
    ]
    message = AssistantMessage(content=parsed.content or None, tool_calls=calls)
    return message, finish_reason(reason, True)


class ToolDeltas:
    """One streamed choice: each engine delta into an OpenAI delta (None: nothing to send yet)."""

    def __init__(self) -> None:
        self.stream = ToolCallStream()

    def delta(self, text: str, reason: str | None) -> tuple[Delta | None, str | None]:
        content, calls = self.stream.feed(text, final=reason is not None)
        tool_calls = [
            ToolCallDelta(
                index=d.index,
                id=d.id,
                type="function" if d.id is not None else None,
                function=FunctionDelta(name=d.name, arguments=d.arguments),
            )
            for d in calls
        ]
        reason = finish_reason(reason, bool(self.stream.ids))
        if not content and not tool_calls:
            return None, reason
        return Delta(content=content or None, tool_calls=tool_calls or None), reason
