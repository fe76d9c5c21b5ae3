"""gpt-oss's harmony format: an answer's messages into reasoning, content and tool calls.

An answer is a run of messages `HEADER<|message|>BODY` closed by `<|end|>`, `<|return|>` (the
final answer's end) or `<|call|>` (a tool call's end); the generation prompt ends
`<|start|>assistant`, so the answer opens with its first header, and each later message with
`<|start|>assistant`. A header names the channel (`<|channel|>analysis`, `final`,
`commentary`) and, for a call, its recipient (`to=functions.NAME`, before or after the
channel), then maybe the body's type (`<|constrain|>json`):

    <|channel|>analysis<|message|>Let me look.<|end|><|start|>assistant<|channel|>commentary
    to=functions.weather <|constrain|>json<|message|>{"city": "Oslo"}<|call|>

The analysis channel is the reasoning; a `functions.` recipient's body is a call's arguments;
the final and commentary channels' text is the content. Bodies of other recipients (gpt-oss's
built-in browser and python tools) are reasoning: the model's own work, not the user's calls.

Parsed here from the text, not by openai-harmony: its parser reads token ids of OpenAI's
o200k vocabulary, whose file it downloads on first use (TIKTOKEN_ENCODINGS_BASE may point at a
local copy), so it cannot run offline, and only gpt-oss's own tokenizer has those ids. The text
keeps the markers (they are special tokens, which requests in this format do not skip).
"""

import dataclasses
import re
from collections.abc import Callable
from typing import TypeVar

from tinyllm.text.tool_calls import CallDelta, new_call_id

START, END, MESSAGE = "<|start|>", "<|end|>", "<|message|>"
CHANNEL, CONSTRAIN, RETURN, CALL = "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"
# The tokens that end an answer: generation stops at them.
STOP_TOKENS = (RETURN, CALL)
# What closes a body: a `<|start|>` closes one the model left open.
_CLOSERS = (END, RETURN, CALL, START)
_FUNCTIONS = "functions."
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
P = TypeVar("P")


def is_harmony(template: str | None) -> bool:
    """Whether a chat template writes the harmony format (gpt-oss's)."""
    return bool(template) and all(m in template for m in (START, CHANNEL, MESSAGE))


class HarmonySplit:
    """One answer's text into (reasoning, content, call deltas), fed delta by delta. Text that
    may still be the start of a marker is held back until the next delta says, so a streamed
    answer reassembles to exactly the whole one; each delta is read once."""

    def __init__(self) -> None:
        self.text = ""
        self.pos = 0  # the first character not yet given out (or, in a header, its start)
        self.search = 0  # where the search for the next marker goes on
        self.in_header = True
        self.part = "content"  # the open body's: "reasoning", "content" or "call"
        self.ids: list[str] = []  # of the calls begun so far
        self.complete: list[bool] = []  # whether each one's body was closed
        self.ends = 0  # `<|end|>` markers read
        self.thought_end = 0  # which of them closed the last analysis message (0: none)

    @property
    def thinking(self) -> bool:
        """Whether the text so far ends inside the reasoning."""
        return not self.in_header and self.part == "reasoning"

    def feed(self, delta: str, final: bool, cut: bool = False) -> tuple[str, str, list[CallDelta]]:
        """`cut`: the answer ended at max_tokens (a marker it began is not text)."""
        self.text += delta
        text = self.text
        parts: dict[str, str] = {"reasoning": "", "content": ""}
        calls: list[CallDelta] = []
        while True:
            if self.in_header:
                at = text.find(MESSAGE, self.search)
                if at < 0:
                    self.search = max(self.pos, len(text) - len(MESSAGE) + 1)
                    if final:  # text outside any message: plain content unless it is markup
                        rest = text[self.pos :]
                        if "<|" not in rest:
                            parts["content"] += rest
                        self.pos = len(text)
                    break
                self._open(text[self.pos : at], calls)
                self.pos = self.search = at + len(MESSAGE)
                self.in_header = False
                continue
            at, marker = self._closer(text)
            stop = at if marker else len(text) - (0 if final and not cut else at)
            body = text[self.pos : stop]
            if self.part == "call":
                if body:
                    calls.append(CallDelta(len(self.ids) - 1, body))
            else:
                parts[self.part] += body
            if not marker:
                self.pos = self.search = stop
                break
            self._close(marker)
            self.in_header = True
            self.pos = self.search = at if marker == START else at + len(marker)
        return parts["reasoning"], parts["content"], calls

    def _open(self, header: str, calls: list[CallDelta]) -> None:
        """Start the body of the message `header` describes."""
        recipient = _RECIPIENT.search(header)
        channel = _CHANNEL_NAME.search(header)
        if recipient and recipient.group(1).startswith(_FUNCTIONS):
            self.part = "call"
            self.ids.append(new_call_id())
            self.complete.append(False)
            name = recipient.group(1)[len(_FUNCTIONS) :]
            calls.append(CallDelta(len(self.ids) - 1, "", id=self.ids[-1], name=name))
        elif recipient or (channel and channel.group(1) == "analysis"):
            self.part = "reasoning"
        else:
            self.part = "content"

    def _close(self, marker: str) -> None:
        if marker == END:
            self.ends += 1
            if self.part == "reasoning":
                self.thought_end = self.ends
        if self.part == "call":
            self.complete[-1] = marker != START

    def _closer(self, text: str) -> tuple[int, str]:
        """The next marker that closes the body, and where; without one, ("", how much of the
        end may still begin one)."""
        i = self.search
        while True:
            at = text.find("<|", i)
            if at < 0:
                self.search = max(self.pos, len(text) - 1)
                return int(text.endswith("<")), ""
            marker = next((m for m in _CLOSERS if text.startswith(m, at)), "")
            if marker:
                return at, marker
            if any(m.startswith(text[at:]) for m in _CLOSERS):
                self.search = at
                return len(text) - at, ""
            i = at + 2

    def reasoning_tokens(self, token_ids: list[int], end_id: int | None) -> int:
        """How many of an answer's tokens (`token_ids`, all of them) are its reasoning: up to
        the `<|end|>` of its last analysis message (markers included)."""
        if self.thinking:
            return len(token_ids)
        if not self.thought_end or end_id is None:
            return 0
        seen = 0
        for i, t in enumerate(token_ids):
            seen += t == end_id
            if seen == self.thought_end:
                return i + 1
        return len(token_ids)  # the marker spelled out in text


def keep_markers(params: P, token_to_id: Callable[[str], int | None]) -> P:
    """`params` (SamplingParams) for a harmony answer: the markers kept in its text for
    HarmonySplit, and generation ending at STOP_TOKENS (those the vocabulary has)."""
    stops = [i for i in map(token_to_id, STOP_TOKENS) if i is not None]
    return dataclasses.replace(
        params, skip_special_tokens=False, stop_token_ids=[*params.stop_token_ids, *stops]
    )


def thinking_off() -> str:
    """What to append to a prompt so that the model answers without reasoning: an empty
    analysis message, as an answer that thought nothing."""
    return f"{CHANNEL}analysis{MESSAGE}{END}{START}assistant"
