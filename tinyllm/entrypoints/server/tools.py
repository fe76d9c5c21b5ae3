"""Tool calling on the chat path: the request's tools and tool_choice into a prompt and a grammar
in the model's tool-call format (tinyllm.text.tool_formats). The answer's calls are parsed out by
tinyllm.text.answer: no markup reaches the content, and a call that did not complete (cut by
max_tokens or a stop string) finishes with "length", never "tool_calls"."""

import json
import re
from dataclasses import dataclass
from typing import Any

from tinyllm.engine.structured_output.params import StructuredOutputsParams
from tinyllm.entrypoints.server.engine_requests import request_constraint
from tinyllm.entrypoints.server.errors import APIError
from tinyllm.entrypoints.server.protocol import (
    ChatCompletionRequest,
)
from tinyllm.text.tool_formats import GENERIC, ToolFormat
from tinyllm.text.tool_grammar import check_answer, tool_choice_grammar


@dataclass
class ToolPlan:
    tools: list[dict[str, Any]] | None  # for the chat template
    constraint: StructuredOutputsParams | None  # None: tools are not what constrains the answer
    parse: bool  # whether answers are parsed for calls
    format: ToolFormat = GENERIC  # the calls' format, to parse them with


def plan_tools(
    req: ChatCompletionRequest,
    constrained: bool,
    fmt: ToolFormat = GENERIC,
    tokens: frozenset[str] = frozenset(),
) -> ToolPlan:
    """`constrained`: the request has its own response_format or structured_outputs. A JSON
    schema (or json_object) there goes into the tools' grammar: the answer is either calls or
    that JSON (OpenAI's way); other constraints leave room for tool_choice none only. `fmt`:
    the model's tool-call format (LLM.tool_format); `tokens`: its vocabulary's added tokens."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return ToolPlan(None, None, False, fmt)
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    if choice is None:
        choice = "auto"
    elif not isinstance(choice, str):
        choice = choice.model_dump()
    own = request_constraint(req) if constrained else None
    if own is not None and choice == "none":
        # Rendered for the model to know, never called: the request's constraint applies.
        _grammar(tools, choice, req, fmt, None, tokens)
        return ToolPlan(tools, None, False, fmt)
    answer = None
    if own is not None:
        answer = _answer_schema(own.params)
        if answer is None:
            raise APIError(
                400,
                f"{own.where} with tools: only a JSON schema or json_object combines with "
                "calls; give tool_choice none, or drop one",
                param="tool_choice",
            )
        try:
            check_answer(answer)
        except ValueError as e:
            raise APIError(400, f"{own.where}: {e}", param=own.where.split(".")[0]) from e
    grammar = _grammar(tools, choice, req, fmt, answer, tokens)
    return ToolPlan(tools, StructuredOutputsParams(grammar=grammar), choice != "none", fmt)


def _answer_schema(params: StructuredOutputsParams) -> dict[str, Any] | None:
    if params.json_object:
        return {"type": "object"}
    if isinstance(params.json, str):
        try:
            return json.loads(params.json)
        except ValueError:
            return None
    return params.json


def _grammar(
    tools, choice, req: ChatCompletionRequest, fmt: ToolFormat, answer, tokens: frozenset[str]
) -> str:
    try:
        parallel = bool(req.parallel_tool_calls)
        return tool_choice_grammar(tools, choice, parallel, fmt, answer, tokens)
    except ValueError as e:  # "tools.1.function.parameters (f): ..." or "tool_choice: ..."
        raise APIError(400, str(e), param=re.match(r"\w+", str(e)).group()) from e


def finish_reason(reason: str | None, has_calls: bool, complete: bool = True) -> str | None:
    """ "tool_calls" for an answer that ended with its calls; "length" where one is incomplete
    (a stop string inside it), as OpenAI reports a call cut short."""
    if has_calls and reason == "stop":
        return "tool_calls" if complete else "length"
    return reason
