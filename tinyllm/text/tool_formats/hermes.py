"""Hermes/Qwen `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks: Qwen2.5,
Qwen3, Hermes 2/3, and tinyllm's generic format for templates without tools."""

from typing import Any

from tinyllm.text.tool_calls import CALL_END, CALL_START, HermesScan
from tinyllm.text.tool_formats.base import ToolFormat, dumps
from tinyllm.text.tool_grammar import tool_grammar


class Hermes(ToolFormat):
    name = "hermes"
    scan = HermesScan
    instruction = (
        "For each function call, return a json object with function name and arguments within "
        f"<tool_call></tool_call> XML tags:\n{CALL_START}\n"
        f'{{"name": <function-name>, "arguments": <args-json-object>}}\n{CALL_END}'
    )

    def detect(self, template: str) -> bool:
        return CALL_START in template

    def grammar(
        self,
        functions: list[dict[str, Any]],
        choice: str,
        parallel: bool,
        answer: dict[str, Any] | None = None,
        tokens: frozenset[str] = frozenset(),
    ) -> str:
        return tool_grammar(functions, choice, parallel, answer, tokens)

    def calls_text(self, calls: list[tuple[str, Any]]) -> str:
        return "\n".join(
            f"{CALL_START}\n{dumps({'name': n, 'arguments': a})}\n{CALL_END}" for n, a in calls
        )


HERMES = Hermes()
