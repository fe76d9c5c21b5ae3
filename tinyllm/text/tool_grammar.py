"""Lark grammars (llguidance's dialect) that make a model's tool calls well formed.

Every call is `<tool_call>\\n{"name": <a function>, "arguments": <valid against its
parameters>}\\n</tool_call>` (what Qwen's templates teach), its JSON written with `, ` and `: `
as Python's json.dumps does, so a model sees its own format.

- `required` / a named function: the whole answer is one call (or several, one per line, with
  parallel calls), nothing else.
- `auto`: any text, until the text contains `<tool_call>`: a lazy lexeme ends there and from then
  on the rest must be calls (llama.cpp's lazy grammar with a trigger word).
- `none`: any text that never contains `<tool_call>`.
"""

import json
import re
from typing import Any

import llguidance

from tinyllm.text.json_schema import closed_objects
from tinyllm.text.tool_calls import CALL_END, CALL_START

# Fixed separators: a model free to put whitespace anywhere can spend its tokens on it.
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_NL = "\n"
# A function without `parameters` takes none (OpenAI's rule): its arguments are {}.
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def arguments_schema(function: dict[str, Any]) -> dict[str, Any]:
    """A function's `parameters`, its objects closed to other properties unless they say
    otherwise (as OpenAI's strict mode does): a small model otherwise invents arguments it was
    not given."""
    return closed_objects(function.get("parameters") or _NO_PARAMETERS)


def call_schema(functions: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON schema of one call body: any of `functions` (OpenAI's function objects)."""
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": f["name"]}, "arguments": arguments_schema(f)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in functions
    ]
    return {"anyOf": options, "x-guidance": _JSON_STYLE}


def check_parameters(functions: list[dict[str, Any]]) -> None:
    """ValueError naming the function whose parameters schema llguidance cannot compile."""
    for i, f in enumerate(functions):
        schema = arguments_schema(f)
        try:
            error = llguidance.LLMatcher.validate_grammar(
                llguidance.LLMatcher.grammar_from_json_schema(schema)
            )
        except ValueError as e:  # not a JSON object at all
            error = str(e)
        if error:
            raise ValueError(f"tools.{i}.function.parameters ({f['name']}): {error.strip()}")


def tool_choice_grammar(
    tools: list[dict[str, Any]], tool_choice: str | dict[str, Any] = "auto", parallel: bool = False
) -> str:
    """The grammar for OpenAI's `tools` and `tool_choice` ("none", "auto", "required" or
    {"type": "function", "function": {"name": ...}}); ValueError naming the field at fault."""
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise ValueError(
                f'tools.{i}: give {{"type": "function", "function": {{"name": ..., '
                f'"parameters": ...}}}}, not {t!r:.80}'
            )
    functions = [t["function"] for t in tools]
    names = [f["name"] for f in functions]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"tools: the function name {twice[0]!r} is given twice")
    check_parameters(functions)
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        if name not in names:
            raise ValueError(f"tool_choice: no function {name!r} in tools ({', '.join(names)})")
        return tool_grammar([functions[names.index(name)]], "required", parallel)
    if tool_choice not in ("none", "auto", "required"):
        raise ValueError(
            f"tool_choice: {tool_choice!r} is not none, auto, required or a named function"
        )
    return tool_grammar(functions, tool_choice, parallel)


def tool_grammar(functions: list[dict[str, Any]], choice: str, parallel: bool) -> str:
    """The grammar for tool_choice `choice` ("auto", "required" or "none"; a named function
    is "required" over just that function)."""
    if choice == "none":
        no_call = f"/(?s:.*)/ & ~/(?s:.*){re.escape(CALL_START)}(?s:.*)/"
        return f"%llguidance {{}}\nstart: NO_CALL\nNO_CALL: {no_call}\n"
    more = '("\\n" call)*' if parallel else ""
    body = f"{json.dumps(_NL)} body {json.dumps(_NL + CALL_END)}"
    rules = [
        "%llguidance {}",
        f"call: {json.dumps(CALL_START)} {body}",
        f"body: %json {json.dumps(call_schema(functions))}",
    ]
    if choice == "auto":
        # The trigger ends the text lexeme: from there on only calls are possible.
        rules += [
            f"start: TEXT | text_then_call {body} {more}",
            f"text_then_call[lazy]: TEXT {json.dumps(CALL_START)}",
            "TEXT: /(?s:.*)/",
        ]
    else:
        rules.append(f"start: call {more}")
    return "\n".join(rules) + "\n"
