"""A chat answer's text, as the model writes it, into what clients are shown apart: the
reasoning (a thinking model's `<think>` part), the content, and the tool calls. A harmony answer
(gpt-oss's) is split by its channels instead, calls included (tinyllm.text.harmony).

One `AnswerStream` per answer. The server feeds it each streamed delta; `LLM.chat` and the
server's whole (non-streamed) answers feed it the whole text once. Every dialect (OpenAI chat,
Responses, Anthropic Messages, Ollama) shapes the same `AnswerDelta`s, so a streamed answer
reassembles to exactly the whole one.
"""

from dataclasses import dataclass, field
from typing import Protocol

from tinyllm.text.harmony import HarmonySplit
from tinyllm.text.tool_calls import CallDelta, ToolCall, ToolCallStream
from tinyllm.text.tool_formats import ToolFormat


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
    """`reasoning`: the model's thinking splitter (None: it does not think). `tools`: the
    format of the tool calls the answer may hold, parsed out of the content (None: no calls).
    A `HarmonySplit` as `reasoning` splits off the calls itself (`tools` is not read)."""

    def __init__(
        self,
        reasoning: ReasoningSplit | HarmonySplit | None = None,
        tools: ToolFormat | None = None,
    ) -> None:
        self.reasoning = reasoning
        self.channels = reasoning if isinstance(reasoning, HarmonySplit) else None
        use_tools = tools is not None and self.channels is None
        self.tools = ToolCallStream(tools.scan) if use_tools else None

    @property
    def has_calls(self) -> bool:
        if self.channels is not None:
            return bool(self.channels.ids)
        return bool(self.tools and self.tools.ids)

    @property
    def calls_complete(self) -> bool:
        """Whether every call is whole (none was cut by max_tokens or a stop string)."""
        if self.channels is not None:
            return all(self.channels.complete)
        return self.tools is None or self.tools.all_complete

    def feed(self, text: str, final: bool, cut: bool = False) -> AnswerDelta:
        """`cut`: the answer ended at max_tokens (a begun call or trigger is not content)."""
        if self.channels is not None:
            reasoning, content, calls = self.channels.feed(text, final, cut)
            return AnswerDelta(content, reasoning, calls)
        reasoning, content = self.reasoning.feed(text, final) if self.reasoning else ("", text)
        calls: list[CallDelta] = []
        if self.tools is not None:
            content, calls = self.tools.feed(content, final, cut)
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


def parse_answer(
    text: str,
    reasoning: ReasoningSplit | HarmonySplit | None = None,
    tools: ToolFormat | None = None,
) -> Answer:
    """A whole answer's parts."""
    answer = Answer()
    answer.add(AnswerStream(reasoning, tools).feed(text, final=True))
    return answer
