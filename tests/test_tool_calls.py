"""Tool calls in the answer's text: the split into content and calls, and streaming it in any
pieces (a `<tool_call>` arriving split across tokens) reassembles to the whole answer's parse."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tinyllm.text import tool_calls
from tinyllm.text.tool_calls import Parsed, ToolCallStream, parse_tool_calls

CALL = '<tool_call>\n{"name": "add", "arguments": {"x": 1, "y": [2, "}"]}}\n</tool_call>'
WEATHER = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris \\"FR\\""}}\n</tool_call>'
)
# A call whose argument is text holding the end tag itself (a model writing about tool calls).
QUOTED_TAG = (
    '<tool_call>\n{"name": "note", "arguments": {"text": "ends with </tool_call>!"}}\n</tool_call>'
)


def test_text_without_calls_is_content():
    parsed = parse_tool_calls("The answer is 4. <tool is not a call")
    assert parsed.content == "The answer is 4. <tool is not a call"
    assert parsed.calls == []


def test_calls_and_the_text_before_them():
    parsed = parse_tool_calls(f"Let me add those.\n{CALL}\n{WEATHER}")
    assert parsed.content == "Let me add those."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("add", {"x": 1, "y": [2, "}"]}),
        ("get_weather", {"city": 'Paris "FR"'}),
    ]
    assert all(c.complete and c.id.startswith("call_") for c in parsed.calls)
    assert len({c.id for c in parsed.calls}) == 2


def test_an_end_tag_inside_a_string_argument_is_text_not_the_end():
    parsed = parse_tool_calls(f"{QUOTED_TAG}\n{CALL}")
    assert [(c.name, json.loads(c.arguments), c.complete) for c in parsed.calls] == [
        ("note", {"text": "ends with </tool_call>!"}, True),
        ("add", {"x": 1, "y": [2, "}"]}, True),
    ]
    # Outside a string it ends the call, even where the JSON is not closed.
    (call,) = parse_tool_calls('<tool_call>{"name": "f", "arguments": {"a": 1}</tool_call>').calls
    assert (call.name, call.arguments, call.complete) == ("f", '{"a": 1}', True)


def test_arguments_before_the_name_and_compact_json():
    text = '<tool_call>{"arguments":{"q":"a, b"},"name":"search"}</tool_call>'
    (call,) = parse_tool_calls(text).calls
    assert (call.name, call.arguments) == ("search", '{"q":"a, b"}')


def test_a_call_cut_short_is_incomplete_and_a_body_without_a_name_is_dropped():
    (call,) = parse_tool_calls('<tool_call>\n{"name": "add", "arguments": {"x": 1').calls
    assert (call.name, call.arguments, call.complete) == ("add", '{"x": 1', False)
    # Markup never reaches the content: a begun call without a name is dropped with it.
    garbage = "Sure <tool_call> not json"
    assert parse_tool_calls(garbage) == parse_tool_calls(garbage, final=False)
    assert parse_tool_calls(garbage) == Parsed("Sure", [])
    assert parse_tool_calls('Hi <tool_call>\n{"name', cut=True) == Parsed("Hi", [])


def test_unfinished_text_holds_back_what_may_start_a_call():
    assert parse_tool_calls("Hello <tool_c", final=False).content == "Hello"
    assert parse_tool_calls("Hello <", final=False).content == "Hello"
    assert parse_tool_calls("Hello <b>", final=False).content == "Hello <b>"
    assert parse_tool_calls("Hello <tool_c", final=True).content == "Hello <tool_c"
    # An answer max_tokens cut there may have been a call: not content either.
    assert parse_tool_calls("Hello <tool_c", cut=True).content == "Hello"
    assert parse_tool_calls("<tool_", cut=True).content == ""
    assert parse_tool_calls("Hello <b>", cut=True).content == "Hello <b>"


def _pieces(text: str, cuts: list[int]) -> list[str]:
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def _stream(text: str, cuts: list[int]):
    stream = ToolCallStream()
    content, calls = "", {}
    pieces = _pieces(text, cuts)
    for i, piece in enumerate(pieces):
        new, deltas = stream.feed(piece, final=i == len(pieces) - 1)
        content += new
        assert "<tool_call>" not in content
        for d in deltas:
            if d.name is not None:  # the first delta of a call: id and name, no arguments yet
                assert d.index == len(calls) and d.id.startswith("call_") and d.arguments == ""
                calls[d.index] = {"id": d.id, "name": d.name, "arguments": ""}
            else:
                calls[d.index]["arguments"] += d.arguments
    return content, list(calls.values())


@pytest.mark.parametrize(
    "text",
    [
        f"Let me add those.\n{CALL}\n{WEATHER}",
        CALL,
        "Just text, with a < and a <tool but no call.\n",
        "  leading spaces then a call\n\n" + WEATHER,
        f"{QUOTED_TAG}\n{CALL}",
    ],
)
def test_streaming_in_any_pieces_reassembles_to_the_whole_parse(text):
    whole = parse_tool_calls(text)
    expected = [(c.name, c.arguments) for c in whole.calls]
    for step in (1, 2, 3, 7, 11):
        cuts = list(range(step, len(text), step))
        content, calls = _stream(text, cuts)
        assert content == whole.content
        assert [(c["name"], c["arguments"]) for c in calls] == expected
    # The trigger split at every position, the rest in one piece.
    start = max(text.find("<tool_call>"), 0)
    for cut in range(start, start + len("<tool_call>") + 1):
        content, calls = _stream(text, [cut] if 0 < cut < len(text) else [])
        assert (content, [(c["name"], c["arguments"]) for c in calls]) == (
            whole.content,
            expected,
        )


def test_no_markup_reaches_content_while_a_call_streams():
    stream = ToolCallStream()
    sent = ""
    for ch in f"Checking.{CALL}":
        sent += stream.feed(ch, final=False)[0]
    assert sent == "Checking."


def test_bad_json_in_a_call_is_no_name_not_an_error():
    # A number that runs into the brace, a bad escape: the model's text, which used to raise.
    for body in ['{"name": 1}', '{"name": "a\\q", "arguments": {}}']:
        text = f"<tool_call>{body}</tool_call>"
        assert parse_tool_calls(text) == Parsed("", [])
        assert parse_tool_calls(text, final=False) == Parsed("", [])
    (call,) = parse_tool_calls('<tool_call>{"\\x": 1, "name": "f"}</tool_call>').calls
    assert (call.name, call.arguments, call.complete) == ("f", "", False)


def _reparsed(pieces: list[str]) -> list[tuple[str, list[tuple[int, str, bool, str | None]]]]:
    """What streaming sent when each delta parsed the whole text so far again: the oracle for
    the incremental stream (which must send the same, only without reading it all again)."""
    text, content_sent, sent, out = "", 0, [], []
    for i, piece in enumerate(pieces):
        text += piece
        parsed = parse_tool_calls(text, final=i == len(pieces) - 1)
        deltas = []
        for index, call in enumerate(parsed.calls):
            if index == len(sent):
                sent.append("")
                deltas.append((index, "", True, call.name))
            if new := call.arguments[len(sent[index]) :]:
                deltas.append((index, new, False, None))
            sent[index] = call.arguments
        out.append((parsed.content[content_sent:], deltas))
        content_sent = len(parsed.content)
    return out


def _fed(pieces: list[str]) -> list[tuple[str, list[tuple[int, str, bool, str | None]]]]:
    stream = ToolCallStream()
    out = []
    for i, piece in enumerate(pieces):
        content, deltas = stream.feed(piece, final=i == len(pieces) - 1)
        out.append((content, [(d.index, d.arguments, d.id is not None, d.name) for d in deltas]))
    return out


FRAGMENTS = [
    *("<tool_call>", "</tool_call>", "<tool_c", "</tool", "\n", " ", ",", ":", "{", "}", "[", "]"),
    *('"', "\\", "1", "tru", "x", '"name"', '"arguments"', ': "f"', '{"a": [1, "}"]}', '"\\x"'),
    '"a </tool_call> in a string"',
    '{"name": "add", "arguments": {"x": 1}}',
]


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_streaming_sends_what_parsing_the_text_so_far_each_time_sends(data):
    text = "".join(data.draw(st.lists(st.sampled_from(FRAGMENTS), min_size=1, max_size=30)))
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=20)))
    pieces = _pieces(text, [c for c in cuts if c < len(text)])
    assert _fed(pieces) == _reparsed(pieces)


def test_streaming_when_the_end_tag_arrives_split():
    # Read up to `</tool`, the second "arguments" has begun; once `</tool_call>` is whole, it has
    # not, and the first one is the call's arguments again.
    text = '<tool_call>{"name": "f", "arguments": {}, "arguments": </tool_call>'
    for cut in range(text.index("</"), len(text)):
        pieces = _pieces(text, [cut])
        assert _fed(pieces) == _reparsed(pieces)


def test_a_long_call_streamed_in_small_pieces_is_read_once(monkeypatch):
    # Each delta used to parse the whole answer again, so a long call cost its length squared
    # in a Python loop over characters. Count the characters the call scanner reads.
    scanned = 0
    scan = tool_calls._CallScan.scan

    def counting_scan(self, text, stop):
        nonlocal scanned
        scanned += stop - self.next
        return scan(self, text, stop)

    monkeypatch.setattr(tool_calls._CallScan, "scan", counting_scan)
    arguments = json.dumps({"text": 'a "quoted" word, {braces} [and] \\ ' * 150, "n": [1, 2.5]})
    text = f'Writing it.\n<tool_call>\n{{"name": "write", "arguments": {arguments}}}\n</tool_call>'
    assert len(text) > 5000
    content, calls = _stream(text, list(range(3, len(text), 3)))
    whole = parse_tool_calls(text)
    assert content == whole.content == "Writing it."
    assert [(c["name"], c["arguments"]) for c in calls] == [("write", arguments)]
    assert [(c.name, c.arguments) for c in whole.calls] == [("write", arguments)]
    # Read once while streaming and once in the parse.
    assert scanned <= 2 * len(text) + 100
