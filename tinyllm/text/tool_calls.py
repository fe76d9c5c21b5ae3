"""Tool calls in a model's answer, parsed from the whole text or, while streaming, from the text
so far. The machinery here is shared by every format (tinyllm.text.tool_formats); the default
scan reads Hermes-style `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks
(Qwen2.5/Qwen3's format, and tinyllm's generic one).

`parse_tool_calls(text, final=False)` only reports what can no longer change: content stops
before a possible start of the format's trigger or trailing whitespace, a call's name once its
string is closed, its arguments as far as they go. So `ToolCallStream`, which sends what is new
since the last parse, reassembles to exactly the final parse. Once the trigger appears no markup
reaches the content, nor does a possible start of it at the end of an answer cut by max_tokens
(`cut`); a call that never got a name is dropped.

Both read the text with an `AnswerScan`, which keeps where its reading stopped: a streamed delta
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


def parse_tool_calls(
    text: str, final: bool = True, cut: bool = False, scan: "type[AnswerScan] | None" = None
) -> Parsed:
    """Content and calls of `text`; `final=False` for text that may still grow, `cut` for an
    answer that max_tokens ended; `scan`: the format's (default: `<tool_call>` blocks)."""
    answer = (scan or HermesScan)()
    answer.extend(text)
    calls = [
        ToolCall(
            c.function,
            text[slice(*c.arguments_span(text))],
            id=answer.call_id(),
            complete=c.complete,
        )
        for c in answer.calls
        if c.function is not None
    ]
    return Parsed(text[: answer.content_end(final, cut)], calls)


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

    def __init__(self, start: int, arguments_key: str = "arguments") -> None:
        self.start = start  # where the body starts, after <tool_call>
        self.stop = -1  # where </tool_call> starts (or, in a list of calls, the body ends)
        self.closed: int | None = None  # where the object's closing brace ends, once read
        self.arguments_key = arguments_key  # "parameters" in Llama's calls
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
                    elif self.key == self.arguments_key:
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
                if expect == _VALUE and self.key == self.arguments_key:
                    self.arguments, self.arguments_end = i, None
                continue
            elif expect == _COLON:
                expect = _VALUE if c == ":" else _DONE
            else:
                expect = _KEY if c == "," else _DONE
                if c == "}":
                    self.closed = i + 1
            i += 1
        self.next, self.expect = i, expect


class AnswerScan:
    """An answer's calls, read as far as its text goes: the base every format's scan extends.
    `extend` reads only what is new; `trigger_at` is where the calls begin (the content ends),
    once seen; `calls` hold each begun call (with `function`, `complete`, `stop` >= 0 once it
    is finished, and `arguments_span`)."""

    def __init__(self) -> None:
        self.text = ""
        self.calls: list[Any] = []
        self.trigger_at = -1

    def extend(self, delta: str) -> None:
        raise NotImplementedError

    def held_back(self) -> int:
        """How much of the text's end may still turn out to begin the calls."""
        raise NotImplementedError

    def call_id(self) -> str:
        return new_call_id()

    def content_end(self, final: bool, cut: bool = False, known: int = 0) -> int:
        """Where the content ends; `cut`: max_tokens ended the answer, so what may have begun a
        call is not text either. `known`: an end it reaches already (content only grows), so
        that only the text after it is stripped."""
        text = self.text
        if self.trigger_at >= 0:  # text before the calls, which is final
            end = self.trigger_at
        elif final and not cut:
            return len(text)
        else:  # less what could still turn out to be the start of a call
            end = len(text) - self.held_back()
        return known + len(text[known:end].rstrip(_WHITESPACE))


class HermesScan(AnswerScan):
    """`<tool_call>` blocks: a call ends at `</tool_call>` outside its JSON strings."""

    start_tag, end_tag = CALL_START, CALL_END

    def __init__(self) -> None:
        super().__init__()
        self.search_from = 0  # for the end tag while the last call is open, else the start tag

    def held_back(self) -> int:
        return _partial_tag(self.text, self.start_tag)

    def extend(self, delta: str) -> None:
        self.text += delta
        text, start_tag, end_tag = self.text, self.start_tag, self.end_tag
        while True:
            if self.calls and self.calls[-1].stop < 0:
                call = self.calls[-1]
                end = text.find(end_tag, self.search_from)
                if end < 0:
                    self.search_from = max(self.search_from, len(text) - len(end_tag) + 1)
                    # Not into what may begin the end tag: whether it ends the call depends on
                    # the body's state before it (in_string_at), so it is read only once whole.
                    call.scan(text, len(text) - _partial_tag(text, end_tag))
                    return
                if call.in_string_at(text, end):
                    self.search_from = end + 1
                    continue
                call.stop = end
                self.search_from = end + len(end_tag)
            else:
                start = text.find(start_tag, self.search_from)
                if start < 0:
                    self.search_from = max(self.search_from, len(text) - len(start_tag) + 1)
                    return
                if self.trigger_at < 0:
                    self.trigger_at = start
                self.calls.append(_CallScan(start + len(start_tag)))
                self.search_from = start + len(start_tag)


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
    """Turns a streamed answer into content deltas and `CallDelta`s, as OpenAI streams them;
    `scan`: the format's (default: `<tool_call>` blocks)."""

    def __init__(self, scan: type[AnswerScan] | None = None) -> None:
        self.scan = (scan or HermesScan)()
        self.content_sent = 0
        self.ids: list[str] = []  # of the calls begun so far
        self.arguments_sent: list[int] = []  # how much of each one's arguments
        self.settled = 0  # scan.calls before this one are finished, and their deltas sent
        self.settled_named = 0  # how many of those have a name

    @property
    def all_complete(self) -> bool:
        """Whether every named call so far is whole (none was cut by max_tokens or a stop)."""
        return all(c.complete for c in self.scan.calls if c.function is not None)

    def feed(self, delta: str, final: bool, cut: bool = False) -> tuple[str, list[CallDelta]]:
        self.scan.extend(delta)
        text, calls = self.scan.text, self.scan.calls
        out = []
        index = self.settled_named
        for call in calls[self.settled :]:
            if call.function is None:
                continue
            if index == len(self.ids):
                self.ids.append(self.scan.call_id())
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
        end = self.scan.content_end(final, cut, self.content_sent)
        content = text[self.content_sent : end]
        self.content_sent = end
        return content, out
