"""Llama 3.1-3.3's JSON calls: the whole answer is `{"name": ..., "parameters": {...}}` (several
separated by `; `, as vLLM's llama3_json parser reads them), maybe after `<|python_tag|>`.
Llama's templates read `tools` and render them (and calls in the history) themselves."""

import json
from typing import Any

from tinyllm.text.tool_calls import _WHITESPACE
from tinyllm.text.tool_formats.base import ToolFormat, dumps
from tinyllm.text.tool_formats.json_calls import JsonCallsScan
from tinyllm.text.tool_grammar import assemble, call_schema

PYTHON_TAG = "<|python_tag|>"
CALL_OPENING = '{"name"'
_SEPARATOR = "; "


class Llama3JsonScan(JsonCallsScan):
    arguments_key = "parameters"
    between = ";"

    def begin(self) -> int | None:
        text = self.text
        i = len(text) - len(text.lstrip(_WHITESPACE))
        rest = text[i:]
        for opening in (PYTHON_TAG, CALL_OPENING):
            if rest.startswith(opening):
                self.trigger_at = i
                return i + len(PYTHON_TAG) if opening == PYTHON_TAG else i
        if rest and not any(o.startswith(rest) for o in (PYTHON_TAG, CALL_OPENING)):
            self.done = True  # a text answer
        return None

    def held_back(self) -> int:
        return 0 if self.done else len(self.text)


class Llama3Json(ToolFormat):
    name = "llama3_json"
    scan = Llama3JsonScan
    instruction = (
        "To call a function, answer with only a json object with its name and parameters:\n"
        '{"name": <function-name>, "parameters": <args-json-object>}'
    )

    def detect(self, template: str) -> bool:
        return PYTHON_TAG in template or "Environment: ipython" in template

    def grammar(
        self,
        functions: list[dict[str, Any]],
        choice: str,
        parallel: bool,
        answer: dict[str, Any] | None = None,
        tokens: frozenset[str] = frozenset(),
    ) -> str:
        more = f"({json.dumps(_SEPARATOR)} body)*" if parallel else ""
        rules = [
            f"calls: body {more}",
            f"body: %json {json.dumps(call_schema(functions, 'parameters'))}",
        ]
        # Text may not begin with a brace at all: a lexeme that could still become a call's
        # start makes llguidance's lexer drop the call's JSON beside it.
        begins_call = r"[ \t\n]*(\{|<\|python_tag\|>)(?s:.*)"
        return assemble(rules, choice, f"/(?s:.*)/ & ~/{begins_call}/", answer, None, tokens)

    def calls_text(self, calls: list[tuple[str, Any]]) -> str:
        return _SEPARATOR.join(dumps({"name": n, "parameters": a}) for n, a in calls)


LLAMA3_JSON = Llama3Json()
