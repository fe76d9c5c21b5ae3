"""Lark grammars (llguidance's dialect) that make a model's tool calls well formed: the parts
every format shares (tinyllm.text.tool_formats holds each format's own rules).

A call's JSON is written with `, ` and `: ` as Python's json.dumps does, so a model sees its own
format. What each `tool_choice` allows:

- `required` / a named function: the whole answer is calls (one, or several with parallel
  calls), nothing else.
- `auto`: any text, until the format's trigger (`<tool_call>`, `[TOOL_CALLS]`, or a call at the
  start of the answer): from there on the rest must be calls (llama.cpp's lazy grammar with a
  trigger word).
- `none`: any text that never begins a call.

With a response format beside the tools (`answer`, a JSON schema), `auto` is either that JSON
or the calls, and `required` the calls.

This module's `tool_grammar` is the generic format's (Hermes/Qwen `<tool_call>` blocks).
"""

import json
import re
from typing import Any, Protocol

import llguidance

from tinyllm.text.json_schema import closed_objects
from tinyllm.text.tool_calls import CALL_END, CALL_START

# Fixed separators: a model free to put whitespace anywhere can spend its tokens on it.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_NL = "\n"
# A function without `parameters` takes none (OpenAI's rule): its arguments are {}.
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
_DEFS = ("$defs", "definitions")
HEADER = "%llguidance {}"


class GrammarFormat(Protocol):
    def grammar(
        self,
        functions: list[dict[str, Any]],
        choice: str,
        parallel: bool,
        answer: dict[str, Any] | None = None,
        tokens: frozenset[str] = frozenset(),
    ) -> str: ...


def arguments_schema(function: dict[str, Any]) -> dict[str, Any]:
    """A function's `parameters`, its objects closed to other properties unless they say
    otherwise (as OpenAI's strict mode does): a small model otherwise invents arguments it was
    not given."""
    return closed_objects(function.get("parameters") or _NO_PARAMETERS)


def answer_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A response format's schema as the grammars take it (as structured output compiles it)."""
    out = closed_objects(schema)
    return {"x-guidance": {"whitespace_flexible": False}, **out}


def call_schema(functions: list[dict[str, Any]], arguments_key: str = "arguments") -> dict:
    """The JSON schema of one call body `{"name": ..., <arguments_key>: ...}`: any of
    `functions` (OpenAI's function objects). A function's `$defs` (what Pydantic writes for
    nested models) move to the root, renamed per function, with its `$ref`s pointed there."""
    options, defs = [], {}
    for i, f in enumerate(functions):
        arguments = arguments_schema(f)
        if _has_ref(arguments):
            defs.update(_hoisted(f"f{i}", arguments))
            arguments = {"$ref": f"#/$defs/f{i}"}
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": f["name"]}, arguments_key: arguments},
                "required": ["name", arguments_key],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"anyOf": options, "x-guidance": JSON_STYLE}
    return {**schema, "$defs": defs} if defs else schema


def _has_ref(schema: Any) -> bool:
    if isinstance(schema, dict):
        return "$ref" in schema or any(_has_ref(v) for v in schema.values())
    return isinstance(schema, list) and any(_has_ref(v) for v in schema)


def _hoisted(prefix: str, schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` and its definitions as root `$defs` entries: itself as `prefix`, each of its
    definitions as `prefix_NAME`; every local `$ref` rewritten to point there."""

    def moved(ref: str) -> str:
        for key in _DEFS:
            if ref.startswith(f"#/{key}/"):
                return f"#/$defs/{prefix}_{ref[len(key) + 3 :]}"
        return f"#/$defs/{prefix}{ref[1:]}"  # into the schema itself ("#", "#/properties/a")

    def rewrite(node: Any) -> Any:
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        if not isinstance(node, dict):
            return node
        out = {k: rewrite(v) for k, v in node.items()}
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            out["$ref"] = moved(ref)
        return out

    body = {k: v for k, v in schema.items() if k not in _DEFS}
    hoisted = {prefix: rewrite(body)}
    for key in _DEFS:
        for name, definition in (schema.get(key) or {}).items():
            hoisted[f"{prefix}_{name}"] = rewrite(definition)
    return hoisted


def check_parameters(functions: list[dict[str, Any]]) -> None:
    """ValueError naming the function whose parameters schema llguidance cannot compile."""
    for i, f in enumerate(functions):
        error = _schema_error(arguments_schema(f))
        if error:
            raise ValueError(f"tools.{i}.function.parameters ({f['name']}): {error}")


def check_answer(schema: Any) -> None:
    """ValueError saying why llguidance cannot compile a response format's JSON schema."""
    error = _schema_error(answer_schema(schema)) if isinstance(schema, dict) else "not an object"
    if error:
        raise ValueError(error)


def _schema_error(schema: Any) -> str:
    try:
        error = llguidance.LLMatcher.validate_grammar(
            llguidance.LLMatcher.grammar_from_json_schema(schema)
        )
    except ValueError as e:  # not a JSON object at all
        error = str(e)
    return error.strip()


def lark_literal(text: str, tokens: frozenset[str]) -> str:
    """`text` in a grammar: one of the vocabulary's added `tokens` as that token (llguidance
    matches an added token only by name, never as text), else as quoted text."""
    return text if text in tokens else json.dumps(text)


def tool_choice_grammar(
    tools: list[dict[str, Any]],
    tool_choice: str | dict[str, Any],
    parallel: bool,
    fmt: GrammarFormat,
    answer: dict[str, Any] | None = None,
    tokens: frozenset[str] = frozenset(),
) -> str:
    """The grammar of format `fmt` for OpenAI's `tools` and `tool_choice` ("none", "auto",
    "required" or {"type": "function", "function": {"name": ...}}), and `answer`, the JSON
    schema a text answer follows; `tokens`: the vocabulary's added tokens (a tag that is one
    is named as a token). ValueError naming the field at fault."""
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
        return fmt.grammar([functions[names.index(name)]], "required", parallel, answer, tokens)
    if tool_choice not in ("none", "auto", "required"):
        raise ValueError(
            f"tool_choice: {tool_choice!r} is not none, auto, required or a named function"
        )
    return fmt.grammar(functions, tool_choice, parallel, answer, tokens)


def assemble(
    rules: list[str],
    choice: str,
    no_call: str,
    answer: dict[str, Any] | None,
    lazy: tuple[str, str] | None,
    tokens: frozenset[str] = frozenset(),
) -> str:
    """A format's grammar from its rules (which define `calls`, the calls region), `no_call`
    (the regex of text that begins no call) and, for `auto` where calls may follow text,
    `lazy`: the trigger and the rule for what follows it (the text before it is a lazy lexeme
    that ends at the trigger)."""
    if choice == "none":
        return f"{HEADER}\nstart: NO_CALL\nNO_CALL: {no_call}\n"
    out = [HEADER, *rules]
    if answer is not None:
        out.append(f"answer: %json {json.dumps(answer_schema(answer))}")
    if choice != "auto":
        out.append("start: calls")
    elif answer is not None:
        out.append("start: answer | calls")
    elif lazy is not None:
        trigger, rest = lazy
        out += [
            f"start: TEXT | text_then_call {rest}",
            f"text_then_call[lazy]: TEXT {lark_literal(trigger, tokens)}",
            "TEXT: /(?s:.*)/",
        ]
    else:
        out += ["start: NO_CALL | calls", f"NO_CALL: {no_call}"]
    return "\n".join(out) + "\n"


def without(pattern: str) -> str:
    """The regex of any text in which `pattern` (a regex) never occurs."""
    return f"/(?s:.*)/ & ~/(?s:.*){pattern}(?s:.*)/"


def tool_grammar(
    functions: list[dict[str, Any]],
    choice: str,
    parallel: bool,
    answer: dict[str, Any] | None = None,
    tokens: frozenset[str] = frozenset(),
) -> str:
    """The generic format's grammar for tool_choice `choice` ("auto", "required" or "none"; a
    named function is "required" over just that function): `<tool_call>` blocks, one a line."""
    more = '("\\n" call)*' if parallel else ""
    nl = json.dumps(_NL)
    body = f"{nl} body {nl} {lark_literal(CALL_END, tokens)}"
    rules = [
        f"calls: call {more}",
        f"call: {lark_literal(CALL_START, tokens)} {body}",
        f"body: %json {json.dumps(call_schema(functions))}",
    ]
    lazy = (CALL_START, f"{body} {more}")
    return assemble(rules, choice, without(re.escape(CALL_START)), answer, lazy, tokens)
