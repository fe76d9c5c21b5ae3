"""A chat answer's text, as the model writes it, into what clients are shown apart: the
reasoning (a thinking model's `<think>` part), the content, and the tool calls.

One `AnswerStream` per answer. The server feeds it each streamed delta; `LLM.chat` and the
server's whole (non-streamed) answers feed it the whole text once. Every dialect (OpenAI chat,
Responses, Anthropic Messages, Ollama) shapes the same `AnswerDelta`s, so a streamed answer
reassembles to exactly the whole one.
"""

from dataclasses import dataclass, field
from typing import Protocol

from tinyllm.text.tool_calls import CallDelta, ToolCall, ToolCallStream


class ReasoningSplit(Protocol):
    """Splits text into (reasoning, rest) as it streams; `final`: no more text follows."""

    def feed(self, delta: str, final: bool) -> tuple[str, str]: ...


@dataclass
class AnswerDelta:
    """What is new in an answer: text for each part, and tool-call pieces (a call's id and
    name the first time, then argument text)."""

    content: str = ""
    reasoning: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.calls)


class AnswerStream:
    """`reasoning`: the model's thinking splitter (None: it does not think). `tools`: whether
    the answer may hold tool calls (they are parsed out of the content)."""

    def __init__(self, reasoning: ReasoningSplit | None = None, tools: bool = False) -> None:
        self.reasoning = reasoning
        self.tools = ToolCallStream() if tools else None

    @property
    def has_calls(self) -> bool:
        return bool(self.tools and self.tools.ids)

    def feed(self, text: str, final: bool) -> AnswerDelta:
        reasoning, content = self.reasoning.feed(text, final) if self.reasoning else ("", text)
        calls: list[CallDelta] = []
        if self.tools is not None:
            content, calls = self.tools.feed(content, final)
        return AnswerDelta(content, reasoning, calls)


@dataclass
class Answer:
    """An answer summed from its deltas."""

    content: str = ""
    reasoning: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def add(self, delta: AnswerDelta) -> None:
        self.content += delta.content
        self.reasoning += delta.reasoning
        for d in delta.calls:
            if d.index == len(self.calls):
                self.calls.append(ToolCall(d.name or "", "", id=d.id or ""))
            self.calls[d.index].arguments += d.arguments


def parse_answer(text: str, reasoning: ReasoningSplit | None = None, tools: bool = False) -> Answer:
    """A whole answer's parts."""
    answer = Answer()
    answer.add(AnswerStream(reasoning, tools).feed(text, final=True))
    return answer
