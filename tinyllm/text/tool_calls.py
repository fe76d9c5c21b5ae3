"""Tool calls in a model's answer: Hermes-style `<tool_call>{"name": ..., "arguments": {...}}
</tool_call>` blocks (Qwen2.5/Qwen3's format, and tinyllm's generic one), parsed from the whole
text or, while streaming, from the text so far.

`parse_tool_calls(text, final=False)` only reports what can no longer change: content stops
before a possible start of `<tool_call>` or trailing whitespace, a call's name once its string
is closed, its arguments as far as they go. So `ToolCallStream`, which sends what is new since
the last parse, reassembles to exactly the final parse.

Both read the text with `_AnswerScan`, which keeps where its reading stopped: a streamed delta
is read once, not the whole answer again (which would be quadratic in a long call's length).
"""

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
_WHITESPACE = " \t\n\r"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    """One call, OpenAI's shape: `arguments` is JSON text (as the model wrote it)."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)
    complete: bool = True  # False: the answer ended inside it (max_tokens)


@dataclass
class Parsed:
    content: str  # the text outside the calls (before the first one, once there are calls)
    calls: list[ToolCall]


def parse_tool_calls(text: str, final: bool = True) -> Parsed:
    """Content and calls of `text`; `final=False` for text that may still grow."""
    scan = _AnswerScan()
    scan.extend(text)
    calls = [
        ToolCall(c.function, text[slice(*c.arguments_span(text))], complete=c.complete)
        for c in scan.calls
        if c.function is not None
    ]
    return Parsed(text[: scan.content_end(final, bool(calls))], calls)


class _Value:
    """A JSON value read as far as the text goes: where it starts, and where the reading stopped
    with the nesting there, so that more text goes on from there."""

    def __init__(self, start: int) -> None:
        self.start = self.next = start
        self.depth, self.in_string, self.escaped = 0, False, False

    def end(self, s: str, stop: int) -> int | None:
        """Where the value ends, or None if `s[:stop]` ends first."""
        depth, in_string, escaped = self.depth, self.in_string, self.escaped
        for j in range(self.next, stop):
            c = s[j]
            if in_string:
                if escaped:
                    escaped = False
                elif c == "\\":
                    escaped = True
                elif c == '"':
                    in_string = False
                    if depth == 0:
                        return j + 1
            elif c == '"':
                in_string = True
            elif c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth <= 0:
                    return j + 1
            elif depth == 0 and (c in _WHITESPACE or c == ","):
                return j  # the end of a number or literal
        self.next, self.depth, self.in_string, self.escaped = stop, depth, in_string, escaped
        return None


def _decoded(raw: str) -> Any:
    """A JSON value, or None where it is not valid JSON (a bad escape, `1}`)."""
    try:
        return json.loads(raw)
    except ValueError:
        return None


_OBJECT, _KEY, _COLON, _VALUE, _COMMA, _DONE = range(6)  # what the body expects next


class _CallScan:
    """A call body `{"name": ..., "arguments": ...}` read as far as the text goes: the name
    (once its string is closed) and where the arguments' raw JSON starts and (once it does)
    ends. `scan` goes on from where the last one stopped."""

    def __init__(self, start: int) -> None:
        self.start = start  # where the body starts, after <tool_call>
        self.stop = -1  # where </tool_call> starts, once seen
        self.next = start  # the next character to take
        self.expect = _OBJECT
        self.key: Any = None
        self.value: _Value | None = None  # the key or value being read
        self.name: Any = None  # the last whole "name" value, decoded
        self.arguments: int | None = None  # where the last "arguments" value starts
        self.arguments_end: int | None = None  # and ends, once it does

    @property
    def function(self) -> str | None:
        return self.name if isinstance(self.name, str) else None

    @property
    def complete(self) -> bool:
        return self.stop >= 0 and self.arguments_end is not None

    def arguments_span(self, text: str) -> tuple[int, int]:
        if self.arguments is None:
            return 0, 0
        if self.arguments_end is not None:
            return self.arguments, self.arguments_end
        return self.arguments, self.stop if self.stop >= 0 else len(text)

    def in_string_at(self, text: str, at: int) -> bool:
        """Whether `at` (not read yet) is inside one of the body's JSON strings: a
        `</tool_call>` there is text of an argument, not the call's end."""
        self.scan(text, at)
        return self.value is not None and self.value.in_string

    def scan(self, text: str, stop: int) -> None:
        """Read the body on, up to `stop`."""
        i, expect = self.next, self.expect
        while i < stop and expect != _DONE:
            if self.value is not None:
                end = self.value.end(text, stop)
                if end is None:
                    i = stop
                    break
                if expect == _KEY:
                    self.key, expect = _decoded(text[self.value.start : end]), _COLON
                else:
                    if self.key == "name":
                        self.name = _decoded(text[self.value.start : end])
                    elif self.key == "arguments":
                        self.arguments_end = end
                    expect = _COMMA
                self.value, i = None, end
                continue
            c = text[i]
            if c in _WHITESPACE:
                pass
            elif expect == _OBJECT:
                expect = _KEY if c == "{" else _DONE
            elif expect == _KEY and c != '"':
                expect = _DONE
            elif expect in (_KEY, _VALUE):
                self.value = _Value(i)  # which reads c itself
                if expect == _VALUE and self.key == "arguments":
                    self.arguments, self.arguments_end = i, None
                continue
            elif expect == _COLON:
                expect = _VALUE if c == ":" else _DONE
            else:
                expect = _KEY if c == "," else _DONE
            i += 1
        self.next, self.expect = i, expect


class _AnswerScan:
    """An answer's calls, read as far as its text goes; `extend` reads only what is new (and
    the few characters before it that a tag may have begun in)."""

    def __init__(self) -> None:
        self.text = ""
        self.calls: list[_CallScan] = []  # every <tool_call> body, with a name or not
        self.search_from = 0  # for </tool_call> while the last call is open, else <tool_call>

    def extend(self, delta: str) -> None:
        self.text += delta
        text = self.text
        while True:
            if self.calls and self.calls[-1].stop < 0:
                call = self.calls[-1]
                end = text.find(CALL_END, self.search_from)
                if end < 0:
                    self.search_from = max(self.search_from, len(text) - len(CALL_END) + 1)
                    # Not into what may begin </tool_call>: whether it ends the call depends on
                    # the body's state before it (in_string_at), so it is read only once whole.
                    call.scan(text, len(text) - _partial_tag(text, CALL_END))
                    return
                if call.in_string_at(text, end):
                    self.search_from = end + 1
                    continue
                call.stop = end
                self.search_from = end + len(CALL_END)
            else:
                start = text.find(CALL_START, self.search_from)
                if start < 0:
                    self.search_from = max(self.search_from, len(text) - len(CALL_START) + 1)
                    return
                self.calls.append(_CallScan(start + len(CALL_START)))
                self.search_from = start + len(CALL_START)

    def content_end(self, final: bool, any_calls: bool, known: int = 0) -> int:
        """Where the content ends, given whether any call has a name; `known`: an end it
        reaches already (content only grows), so that only the text after it is stripped."""
        text = self.text
        if final and not any_calls:  # no call, or none that names a function: all of it is text
            return len(text)
        if self.calls:  # text before the first call, which is final
            end = self.calls[0].start - len(CALL_START)
        else:  # less what could still turn out to be the start of a call
            end = len(text) - _partial_tag(text, CALL_START)
        return known + len(text[known:end].rstrip(_WHITESPACE))


def _partial_tag(text: str, tag: str) -> int:
    """The length of the end of `text` that `tag` starts with (0: none)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


@dataclass
class CallDelta:
    """What is new about call `index`: its id and name the first time, then argument text."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


class ToolCallStream:
    """Turns a streamed answer into content deltas and `CallDelta`s, as OpenAI streams them."""

    def __init__(self) -> None:
        self.scan = _AnswerScan()
        self.content_sent = 0
        self.ids: list[str] = []  # of the calls begun so far
        self.arguments_sent: list[int] = []  # how much of each one's arguments
        self.settled = 0  # scan.calls before this one are finished, and their deltas sent
        self.settled_named = 0  # how many of those have a name

    def feed(self, delta: str, final: bool) -> tuple[str, list[CallDelta]]:
        self.scan.extend(delta)
        text, calls = self.scan.text, self.scan.calls
        out = []
        index = self.settled_named
        for call in calls[self.settled :]:
            if call.function is None:
                continue
            if index == len(self.ids):
                self.ids.append(new_call_id())
                self.arguments_sent.append(0)
                out.append(CallDelta(index, "", id=self.ids[index], name=call.function))
            start, stop = call.arguments_span(text)
            if stop - start > self.arguments_sent[index]:
                out.append(CallDelta(index, text[start + self.arguments_sent[index] : stop]))
            self.arguments_sent[index] = stop - start
            index += 1
        while self.settled < len(calls) and calls[self.settled].stop >= 0:
            self.settled_named += calls[self.settled].function is not None
            self.settled += 1
        end = self.scan.content_end(final, index > 0, self.content_sent)
        content = text[self.content_sent : end]
        self.content_sent = end
        return content, out
