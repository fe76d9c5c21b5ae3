"""A thinking model's answer split into reasoning and content: whole, and streamed split at
every point (and at every pair of points), which must reassemble to exactly the whole."""

import io
import itertools

import pytest

from tinyllm.entrypoints.cli import ThinkingDisplay
from tinyllm.text.answer import AnswerStream, parse_answer
from tinyllm.text.reasoning import (
    ReasoningFormat,
    ThinkSplit,
    plan_thinking,
    reasoning_format,
    template_kwargs,
    thinking_state,
)
from tinyllm.text.tool_formats import GENERIC

FMT = ReasoningFormat()
# (state, model text, reasoning, content)
CASES = [
    ("maybe", "<think>\nLet me see.\n</think>\n\nParis.", "Let me see.", "Paris."),
    ("maybe", "  <think>a < b </thin k</think>ok", "a < b </thin k", "ok"),
    ("maybe", "<think>no end yet, cut by max_tokens", "no end yet, cut by max_tokens", ""),
    ("maybe", "Paris, no thinking.", "", "Paris, no thinking."),
    ("maybe", "<thinking is not the tag", "", "<thinking is not the tag"),
    ("maybe", "<tool_call>\n{}</tool_call>", "", "<tool_call>\n{}</tool_call>"),
    ("maybe", '<think></think>\n\n{"a": 1}', "", '{"a": 1}'),
    ("maybe", "<think>x</think>", "x", ""),
    ("open", "\nthe prompt opened it\n</think>\n\nanswer", "the prompt opened it", "answer"),
    ("open", "<think>written again</think>\n\nanswer", "written again", "answer"),
    ("open", "cut inside", "cut inside", ""),
    (
        "closed",
        "<think>not thinking: the prompt closed it</think>",
        "",
        "<think>not thinking: the prompt closed it</think>",
    ),
    ("maybe", "<think>\n\n</think>\n\n", "", ""),
    ("maybe", "<think>one</think> two </think> three", "one", "two </think> three"),
]


def whole(state: str, text: str) -> tuple[str, str]:
    return ThinkSplit(FMT, state).feed(text, final=True)


def streamed(state: str, pieces: list[str]) -> tuple[str, str]:
    split, reasoning, content = ThinkSplit(FMT, state), "", ""
    for i, piece in enumerate(pieces):
        r, c = split.feed(piece, final=i == len(pieces) - 1)
        reasoning, content = reasoning + r, content + c
    return reasoning, content


@pytest.mark.parametrize(("state", "text", "reasoning", "content"), CASES)
def test_whole_answer_splits(state: str, text: str, reasoning: str, content: str) -> None:
    assert whole(state, text) == (reasoning, content)


@pytest.mark.parametrize(("state", "text", "reasoning", "content"), CASES)
def test_every_split_point_reassembles_to_the_whole(state, text, reasoning, content) -> None:
    for i in range(len(text) + 1):
        assert streamed(state, [text[:i], text[i:]]) == (reasoning, content), i
    for i, j in itertools.combinations(range(len(text) + 1), 2):
        assert streamed(state, [text[:i], text[i:j], text[j:]]) == (reasoning, content), (i, j)
    assert streamed(state, [*text, ""]) == (reasoning, content)  # a character at a time


def test_no_reasoning_is_sent_before_it_is_known_to_be_reasoning() -> None:
    split = ThinkSplit(FMT, "maybe")
    assert split.feed("<thi", final=False) == ("", "")  # may be the tag, or text
    assert split.feed("nk>plan\n</th", final=False) == ("plan", "")  # may be the end tag
    assert split.thinking
    assert split.feed("ink>\n\nans", final=False) == ("", "ans")
    assert not split.thinking and split.thought


def test_answer_stream_splits_reasoning_before_tool_calls() -> None:
    text = '<think>call it</think>\n\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    answer = parse_answer(text, ThinkSplit(FMT, "maybe"), tools=GENERIC)
    assert answer.reasoning == "call it" and answer.content == ""
    assert [(c.name, c.arguments) for c in answer.calls] == [("f", "{}")]
    stream = AnswerStream(ThinkSplit(FMT, "maybe"), tools=GENERIC)
    parts = [stream.feed(text[i : i + 3], final=i + 3 >= len(text)) for i in range(0, len(text), 3)]
    assert "".join(p.reasoning for p in parts) == "call it"
    assert "".join(p.content for p in parts) == ""
    assert "".join(d.arguments for p in parts for d in p.calls) == "{}"


QWEN3_LIKE = (
    "{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
)


def test_format_from_the_template_and_the_parser_flag() -> None:
    assert reasoning_format("auto", QWEN3_LIKE) == ReasoningFormat()
    assert reasoning_format("auto", "{{ messages }}") is None
    assert reasoning_format("auto", None) is None
    assert reasoning_format("none", QWEN3_LIKE) is None
    assert reasoning_format("qwen3", "{{ messages }}") == ReasoningFormat()
    assert reasoning_format("deepseek_r1", None).starts_inside
    with pytest.raises(ValueError, match="reasoning_parser: 'r1' is not one of"):
        reasoning_format("r1", None)


def test_where_the_answer_starts() -> None:
    assert thinking_state(FMT, "<|im_start|>assistant\n") == "maybe"
    assert thinking_state(FMT, "<|im_start|>assistant\n<think>\n") == "open"
    assert thinking_state(FMT, "<|im_start|>assistant\n<think>\n\n</think>\n\n") == "closed"
    r1 = ReasoningFormat(starts_inside=True)
    assert thinking_state(r1, "<｜Assistant｜>") == "open"


def test_thinking_switch() -> None:
    assert template_kwargs(QWEN3_LIKE, False, None) == {"enable_thinking": False}
    # What the request's chat_template_kwargs say wins over the switch.
    assert template_kwargs(QWEN3_LIKE, False, {"enable_thinking": True}) == {
        "enable_thinking": True
    }
    assert template_kwargs("{{ messages }}", False, {"x": 1}) == {"x": 1}
    # A template without a switch: an empty think block is written into the prompt instead.
    assert plan_thinking(FMT, "assistant\n<think>\n", False) == ("</think>\n\n", "closed")
    assert plan_thinking(FMT, "assistant\n", False) == ("<think>\n\n</think>\n\n", "closed")
    assert plan_thinking(FMT, "assistant\n", None) == ("", "maybe")
    assert plan_thinking(None, "assistant\n", False) == ("", "closed")


class Terminal(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize("tty", [True, False], ids=["terminal", "pipe"])
def test_cli_chat_dims_the_thinking(tty: bool) -> None:
    out = Terminal(tty)
    shown = ThinkingDisplay(ThinkSplit(FMT, "maybe"), out)
    for piece in ["<th", "ink>\nsho", "rt plan\n</thi", "nk>\n\nThe", " answer."]:
        shown.write(piece)
    shown.write("", final=True)
    assert shown.content == "The answer."
    dim, plain = ThinkingDisplay.DIM, ThinkingDisplay.PLAIN
    expected = f"{dim}sho{plain}{dim}rt plan{plain}\n\nThe answer." if tty else "The answer."
    assert out.getvalue() == expected
