"""gpt-oss's harmony calls (vLLM's `openai` parser): a commentary message to the function,
`<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`, one per
answer (`<|call|>` ends it). They are parsed with the answer's other messages
(tinyllm.text.harmony); gpt-oss's template renders the tools and past calls itself."""

import json
from typing import Any

from tinyllm.text.harmony import CALL, CHANNEL, CONSTRAIN, MESSAGE, RETURN, START, is_harmony
from tinyllm.text.tool_formats.base import ToolFormat, dumps
from tinyllm.text.tool_grammar import HEADER, JSON_STYLE, answer_schema, arguments_schema
from tinyllm.text.tool_grammar import lark_literal as lit


class Harmony(ToolFormat):
    name = "openai"
    instruction = (
        "To call a function, send a commentary message to it:\n"
        f"{CHANNEL}commentary to=functions.<function-name> {CONSTRAIN}json{MESSAGE}"
        f"<args-json-object>{CALL}"
    )

    def detect(self, template: str) -> bool:
        return is_harmony(template)

    def grammar(
        self,
        functions: list[dict[str, Any]],
        choice: str,
        parallel: bool,
        answer: dict[str, Any] | None = None,
        tokens: frozenset[str] = frozenset(),
    ) -> str:
        """Whole messages, headers included: the final answer (`answer`'s JSON, else any
        text) for "none", a call for "required", either for "auto". One call at most: its
        `<|call|>` ends the answer, whatever `parallel` says."""
        body = "harmony_json" if answer is not None else "HARMONY_TEXT"
        channel, message = lit(CHANNEL, tokens), lit(MESSAGE, tokens)
        final = f'{channel} "final" {message} {body} {lit(RETURN, tokens)}'
        rules = [HEADER, f"harmony_final: {final}"]
        if answer is not None:
            rules.append(f"harmony_json: %json {json.dumps(answer_schema(answer))}")
        else:
            rules.append("HARMONY_TEXT: /(?s:.*)/")
        calls = []
        for i, f in enumerate(functions):
            header = json.dumps(f"commentary to=functions.{f['name']} ")
            calls.append(f"harmony_call{i}")
            rules += [
                f"harmony_call{i}: {channel} {header} {lit(CONSTRAIN, tokens)} "
                f'"json" {message} harmony_args{i} {lit(CALL, tokens)}',
                f"harmony_args{i}: %json "
                + json.dumps({**arguments_schema(f), "x-guidance": JSON_STYLE}),
            ]
        options = {"none": ["harmony_final"], "required": calls}.get(
            choice, ["harmony_final", *calls]
        )
        rules.append(f"start: {' | '.join(options)}")
        return "\n".join(rules) + "\n"

    def calls_text(self, calls: list[tuple[str, Any]]) -> str:
        return "".join(
            f"{START}assistant{CHANNEL}commentary to=functions.{n} {CONSTRAIN}json{MESSAGE}"
            f"{dumps(a)}{CALL}"
            for n, a in calls
        )


HARMONY = Harmony()
