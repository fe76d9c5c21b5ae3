"""Tools and tool messages into a chat template's input.

A template that reads `tools` (Qwen2.5/Qwen3, Hermes, Llama 3.1...) gets them as OpenAI sends
them, and assistant `tool_calls` with their arguments as dicts (what Hugging Face templates
expect). A template that does not (the default model's) gets tinyllm's generic format, the one
Qwen's templates write: the tools in the system message, calls as `<tool_call>` blocks in the
assistant's text, tool results as a user turn of `<tool_response>` blocks (calls and the
instruction in another format where --tool-call-parser names one).
"""

import json
from functools import lru_cache
from typing import Any

import jinja2
from jinja2 import meta

from tinyllm.text.harmony import is_harmony
from tinyllm.text.tool_formats import GENERIC, ToolFormat

_TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)


@lru_cache(maxsize=8)
def template_reads_tools(template: str) -> bool:
    """Whether the template uses a `tools` variable (its own tool format)."""
    try:
        return "tools" in meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateSyntaxError:
        return False  # rendering it will say what is wrong


def tools_system_text(tools: list[dict[str, Any]], fmt: ToolFormat = GENERIC) -> str:
    """The generic system-message block: one JSON line per tool, then how `fmt` calls."""
    lines = "".join(f"\n{json.dumps(tool, ensure_ascii=False)}" for tool in tools)
    return f"{_TOOLS_PREAMBLE}{lines}\n</tools>\n\n{fmt.instruction}"


def template_inputs(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    template: str,
    fmt: ToolFormat = GENERIC,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and extra variables to render `template` with; `fmt`: how calls in the
    history are written where the template does not render them."""
    messages = [_with_dict_arguments(m) for m in messages]
    if is_harmony(template):  # gpt-oss's template reads an earlier answer's `thinking`
        messages = [_with_thinking(m) for m in messages]
    if template_reads_tools(template):
        return messages, ({"tools": tools} if tools else {})
    return _generic(messages, tools, fmt), {}


def _with_thinking(message: dict[str, Any]) -> dict[str, Any]:
    reasoning = message.get("reasoning_content")
    return {**message, "thinking": reasoning} if reasoning else message


def _with_dict_arguments(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls:
        return message
    parsed = []
    for i, call in enumerate(calls):
        function = dict(call["function"])
        if isinstance(function.get("arguments"), str):
            try:
                function["arguments"] = json.loads(function["arguments"])
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"tool_calls.{i}.function.arguments is not JSON ({e}): "
                    f"{function['arguments'][:80]!r}"
                ) from None
        parsed.append({**call, "function": function})
    # A call's message as text "" where the client sent null or nothing: templates index or
    # print it (Devstral's fails on a missing one, Hermes 3 would write "None").
    return {**message, "content": message.get("content") or "", "tool_calls": parsed}


def _generic(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, fmt: ToolFormat
) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if tools:
        block = tools_system_text(tools, fmt)
        if messages[0].get("role") == "system":
            system = messages[0].get("content") or ""
            messages = messages[1:]
            block = f"{system}\n\n{block}" if system else block
        out.append({"role": "system", "content": block})
    after_tool = False
    for m in messages:
        if m.get("role") == "tool":
            response = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if after_tool:  # the results of one turn's calls: one user message
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + response}
            else:
                out.append({"role": "user", "content": response})
        elif m.get("tool_calls"):
            calls = fmt.calls_text(
                [(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]]
            )
            text = "\n".join(([m["content"]] if m.get("content") else []) + [calls])
            out.append({"role": m["role"], "content": text})
        else:
            out.append(m)
        after_tool = m.get("role") == "tool"
    return out
