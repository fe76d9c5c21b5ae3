"""Tool calls in the answer's text: the split into content and calls, and streaming it in any
pieces (a `<tool_call>` arriving split across tokens) reassembles to the whole answer's parse."""

import json

import pytest

from tinyllm.text.tool_calls import ToolCallStream, parse_tool_calls

CALL = '<tool_call>\n{"name": "add", "arguments": {"x": 1, "y": [2, "}"]}}\n</tool_call>'
WEATHER = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris \\"FR\\""}}\n</tool_call>'
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


def test_arguments_before_the_name_and_compact_json():
    text = '<tool_call>{"arguments":{"q":"a, b"},"name":"search"}</tool_call>'
    (call,) = parse_tool_calls(text).calls
    assert (call.name, call.arguments) == ("search", '{"q":"a, b"}')


def test_a_call_cut_short_is_incomplete_and_a_body_without_a_name_is_text():
    (call,) = parse_tool_calls('<tool_call>\n{"name": "add", "arguments": {"x": 1').calls
    assert (call.name, call.arguments, call.complete) == ("add", '{"x": 1', False)
    garbage = "Sure <tool_call> not json"
    assert parse_tool_calls(garbage) == parse_tool_calls(garbage, final=True)
    assert parse_tool_calls(garbage).content == garbage


def test_unfinished_text_holds_back_what_may_start_a_call():
    assert parse_tool_calls("Hello <tool_c", final=False).content == "Hello"
    assert parse_tool_calls("Hello <", final=False).content == "Hello"
    assert parse_tool_calls("Hello <b>", final=False).content == "Hello <b>"
    assert parse_tool_calls("Hello <tool_c", final=True).content == "Hello <tool_c"


def _stream(text: str, cuts: list[int]):
    stream = ToolCallStream()
    content, calls = "", {}
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
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
