"""What a tool-call format is: how a chat template is recognised as using it, the grammar that
makes its calls well formed, the scan that parses them (whole or streamed), and how a call in
the history is written for a template that does not render `tool_calls` itself."""

import json
from typing import Any

from tinyllm.text.tool_calls import AnswerScan


class ToolFormat:
    name: str  # as --tool-call-parser names it (vLLM's names)
    scan: type[AnswerScan]
    instruction: str  # how to call, for a template that does not teach it (tool_prompt.py)

    def detect(self, template: str) -> bool:
        """Whether `template` (a chat template's source) teaches this format."""
        raise NotImplementedError

    def grammar(
        self,
        functions: list[dict[str, Any]],
        choice: str,
        parallel: bool,
        answer: dict[str, Any] | None = None,
        tokens: frozenset[str] = frozenset(),
    ) -> str:
        """The Lark grammar for `choice` ("auto", "required" or "none") over `functions`, and
        `answer`, the JSON schema a text answer follows (tinyllm.text.tool_grammar.assemble);
        `tokens`: the vocabulary's added tokens, which a tag that is one is named as."""
        raise NotImplementedError

    def calls_text(self, calls: list[tuple[str, Any]]) -> str:
        """Calls `(name, arguments)` as the model writes them, for the history."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<tool format {self.name} ({type(self).__name__})>"


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)
