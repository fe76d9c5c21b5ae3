"""Tool calls in a model's answer: Hermes-style `<tool_call>{"name": ..., "arguments": {...}}
</tool_call>` blocks (Qwen2.5/Qwen3's format, and tinyllm's generic one), parsed from the whole
text or, while streaming, from the text so far.

`parse_tool_calls(text, final=False)` only reports what can no longer change: content stops
before a possible start of `<tool_call>` or trailing whitespace, a call's name once its string
is closed, its arguments as far as they go. So `ToolCallStream`, which sends what is new since
the last parse, reassembles to exactly the final parse.
"""

import json
import uuid
from dataclasses import dataclass, field

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
    start = text.find(CALL_START)
    calls: list[ToolCall] = []
    while start >= 0:
        body_start = start + len(CALL_START)
        end = text.find(CALL_END, body_start)
        body = text[body_start:] if end < 0 else text[body_start:end]
        name, arguments, closed = _scan_call(body)
        if name is not None:
            complete = end >= 0 and closed
            calls.append(ToolCall(name, arguments or "", complete=complete))
        if end < 0:
            break
        start = text.find(CALL_START, end + len(CALL_END))
    first = text.find(CALL_START)
    if final and not calls:  # no call, or none that names a function: all of it is text
        return Parsed(text, [])
    if first < 0:  # so far only text
        return Parsed(_settled_text(text), [])
    return Parsed(text[:first].rstrip(_WHITESPACE), calls)


def _settled_text(text: str) -> str:
    """`text` without what could still turn out to be the start of a call: a trailing partial
    `<tool_call>` and the whitespace before it (content before a call is stripped)."""
    for n in range(min(len(CALL_START) - 1, len(text)), 0, -1):
        if CALL_START.startswith(text[-n:]):
            text = text[:-n]
            break
    return text.rstrip(_WHITESPACE)


def _scan_call(body: str) -> tuple[str | None, str | None, bool]:
    """The name (once its string is closed), the arguments' raw JSON so far, and whether the
    arguments are complete, of a call body `{"name": ..., "arguments": ...}` that may be cut."""
    i = _skip_ws(body, 0)
    if not body.startswith("{", i):
        return None, None, False
    name = arguments = None
    closed = False
    i += 1
    while True:
        i = _skip_ws(body, i)
        key_end = _value_end(body, i)
        if key_end is None or not body.startswith('"', i):
            break
        key = json.loads(body[i:key_end])
        i = _skip_ws(body, key_end)
        if not body.startswith(":", i):
            break
        i = _skip_ws(body, i + 1)
        if i == len(body):
            break
        end = _value_end(body, i)
        if key == "name" and end is not None:
            name = json.loads(body[i:end])
        elif key == "arguments":
            arguments, closed = body[i : len(body) if end is None else end], end is not None
        if end is None:
            break
        i = _skip_ws(body, end)
        if not body.startswith(",", i):
            break
        i += 1
    return (name if isinstance(name, str) else None), arguments, closed


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WHITESPACE:
        i += 1
    return i


def _value_end(s: str, i: int) -> int | None:
    """Where the JSON value starting at s[i] ends, or None if s ends first."""
    depth, in_string, escaped = 0, False, False
    for j in range(i, len(s)):
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
        elif depth == 0 and (c in _WHITESPACE or c in ",}]"):
            return j  # the end of a number or literal
    return None


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
        self.text = ""
        self.content_sent = 0
        self.calls: list[ToolCall] = []  # as sent so far, with their ids

    def feed(self, delta: str, final: bool) -> tuple[str, list[CallDelta]]:
        self.text += delta
        parsed = parse_tool_calls(self.text, final)
        content = parsed.content[self.content_sent :]
        self.content_sent = len(parsed.content)
        out = []
        for index, call in enumerate(parsed.calls):
            if index == len(self.calls):
                self.calls.append(ToolCall(call.name, "", complete=False))
                out.append(CallDelta(index, "", id=self.calls[index].id, name=call.name))
            sent = self.calls[index]
            new = call.arguments[len(sent.arguments) :]
            sent.arguments, sent.complete = call.arguments, call.complete
            if new:
                out.append(CallDelta(index, new))
        return content, out
