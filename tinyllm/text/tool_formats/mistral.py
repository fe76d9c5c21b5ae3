"""Mistral's `[TOOL_CALLS]` calls, in the two forms its templates teach: v3 (Mistral 7B v0.3,
Nemo) `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, and v11+ (Small 3.1/3.2,
Devstral, Magistral) `[TOOL_CALLS]name[ARGS]{...}`, once per call. Their templates want call ids
of 9 letters and digits."""

import json
import re
import secrets
import string
from typing import Any

from tinyllm.text.tool_calls import _WHITESPACE, AnswerScan, _partial_tag, _Value
from tinyllm.text.tool_formats.base import ToolFormat, dumps
from tinyllm.text.tool_formats.json_calls import JsonCallsScan
from tinyllm.text.tool_grammar import (
    JSON_STYLE,
    arguments_schema,
    assemble,
    call_schema,
    lark_literal,
    without,
)

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
_ALPHANUMERIC = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))


class _Trigger:
    """The `[TOOL_CALLS]` search shared by both forms' scans."""

    text: str
    trigger_at: int
    search_from = 0

    def held_back(self) -> int:
        return _partial_tag(self.text, TOOL_CALLS)

    def call_id(self) -> str:
        return mistral_call_id()

    def begin(self) -> int | None:
        at = self.text.find(TOOL_CALLS, self.search_from)
        if at < 0:
            self.search_from = max(0, len(self.text) - len(TOOL_CALLS) + 1)
            return None
        self.trigger_at = at
        return at + len(TOOL_CALLS)


class MistralV3Scan(_Trigger, JsonCallsScan):
    between = ",["


class _ArgsCall:
    """One `name[ARGS]{...}` call: the name once `[ARGS]` is whole, then the arguments."""

    def __init__(self, start: int) -> None:
        self.start = self.search_from = start
        self.function: str | None = None
        self.value: _Value | None = None
        self.stop = -1  # where the arguments end, once they do

    @property
    def complete(self) -> bool:
        return self.stop >= 0

    def arguments_span(self, text: str) -> tuple[int, int]:
        if self.value is None:
            return 0, 0
        return self.value.start, self.stop if self.stop >= 0 else len(text)


class MistralV11Scan(_Trigger, AnswerScan):
    def __init__(self) -> None:
        super().__init__()
        self.next = -1
        self.done = False

    def extend(self, delta: str) -> None:
        self.text += delta
        text = self.text
        if self.next < 0:
            found = self.begin()
            if found is None:
                return
            self.next = found
            self.calls.append(_ArgsCall(found))
        while not self.done:
            call = self.calls[-1] if self.calls else None
            if call is not None and call.stop < 0:
                if call.function is None:
                    at = text.find(ARGS, call.search_from)
                    if at < 0:
                        call.search_from = max(call.start, len(text) - len(ARGS) + 1)
                        return
                    name, self.next = text[call.start : at].strip(), at + len(ARGS)
                    if not name:  # not a call: no more calls
                        self.done = True
                        return
                    call.function = name
                if call.value is None:
                    i = self.next
                    while i < len(text) and text[i] in _WHITESPACE:
                        i += 1
                    if i == len(text):
                        self.next = i
                        return
                    call.value = _Value(i)
                end = call.value.end(text, len(text))
                if end is None:
                    return
                call.stop = self.next = end
                continue
            i = self.next
            while i < len(text) and text[i] in _WHITESPACE:
                i += 1
            self.next = i
            if text.startswith(TOOL_CALLS, i):
                self.calls.append(_ArgsCall(i + len(TOOL_CALLS)))
            elif not TOOL_CALLS.startswith(text[i:]):
                self.done = True
            else:
                return  # what may begin the next call


class MistralV3(ToolFormat):
    name = "mistral"
    scan = MistralV3Scan
    instruction = (
        "To call functions, write them as a json list after [TOOL_CALLS]:\n"
        '[TOOL_CALLS][{"name": <function-name>, "arguments": <args-json-object>}]'
    )

    def detect(self, template: str) -> bool:
        return TOOL_CALLS in template

    def grammar(
        self,
        functions: list[dict[str, Any]],
        choice: str,
        parallel: bool,
        answer: dict[str, Any] | None = None,
        tokens: frozenset[str] = frozenset(),
    ) -> str:
        more = '(", " body)*' if parallel else ""
        rest = f'"[" body {more} "]"'
        rules = [
            f"calls: {lark_literal(TOOL_CALLS, tokens)} {rest}",
            f"body: %json {json.dumps(call_schema(functions))}",
        ]
        no_call = without(re.escape(TOOL_CALLS))
        return assemble(rules, choice, no_call, answer, (TOOL_CALLS, rest), tokens)

    def calls_text(self, calls: list[tuple[str, Any]]) -> str:
        bodies = ", ".join(dumps({"name": n, "arguments": a}) for n, a in calls)
        return f"{TOOL_CALLS}[{bodies}]"


class MistralV11(MistralV3):
    scan = MistralV11Scan
    instruction = (
        "For each function call, write [TOOL_CALLS], its name, [ARGS] and its arguments:\n"
        "[TOOL_CALLS]<function-name>[ARGS]<args-json-object>"
    )

    def detect(self, template: str) -> bool:
        return TOOL_CALLS in template and ARGS in template

    def grammar(
        self,
        functions: list[dict[str, Any]],
        choice: str,
        parallel: bool,
        answer: dict[str, Any] | None = None,
        tokens: frozenset[str] = frozenset(),
    ) -> str:
        more = "call*" if parallel else ""
        options = " | ".join(
            f"{json.dumps(f['name'])} {lark_literal(ARGS, tokens)} args{i}"
            for i, f in enumerate(functions)
        )
        rules = [
            f"calls: call {more}",
            f"call: {lark_literal(TOOL_CALLS, tokens)} function",
            f"function: {options}",
            *(
                f"args{i}: %json {json.dumps(_styled(arguments_schema(f)))}"
                for i, f in enumerate(functions)
            ),
        ]
        no_call = without(re.escape(TOOL_CALLS))
        return assemble(rules, choice, no_call, answer, (TOOL_CALLS, f"function {more}"), tokens)

    def calls_text(self, calls: list[tuple[str, Any]]) -> str:
        return "".join(f"{TOOL_CALLS}{n}{ARGS}{dumps(a)}" for n, a in calls)


def _styled(schema: dict[str, Any]) -> dict[str, Any]:
    return {**schema, "x-guidance": JSON_STYLE}


MISTRAL_V3, MISTRAL_V11 = MistralV3(), MistralV11()
