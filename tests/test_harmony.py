"""gpt-oss's harmony format (tinyllm.text.harmony): hand-written answers split into reasoning,
content and tool calls, whole and streamed split at every point (and every pair of points),
which must reassemble to exactly the whole; the grammars run by llguidance over the default
model's tokens with harmony's markers added as special tokens; gpt-oss's real chat template
(tests/data/templates/openai-gpt-oss-120b.jinja) detected and rendered."""

import io
import itertools
from pathlib import Path

import gguf
import llguidance
import pytest

from tests.test_tool_grammar import FUNCTIONS, accepts
from tinyllm.entrypoints.cli import ThinkingDisplay
from tinyllm.text.answer import Answer, AnswerStream, parse_answer
from tinyllm.text.chat_template import render_chat_template
from tinyllm.text.harmony import HarmonySplit
from tinyllm.text.reasoning import (
    HARMONY,
    plan_thinking,
    reasoning_format,
    template_kwargs,
)
from tinyllm.text.reasoning_grammar import harmony_grammar
from tinyllm.text.tokenizer import Tokenizer
from tinyllm.text.tool_formats import HARMONY as HARMONY_CALLS
from tinyllm.text.tool_formats import tool_format
from tinyllm.text.tool_prompt import template_inputs

TEMPLATES = Path(__file__).parent / "data" / "templates"
GPT_OSS = (TEMPLATES / "openai-gpt-oss-120b.jinja").read_text()
MARKERS = [
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|channel|>",
    "<|constrain|>",
    "<|return|>",
    "<|call|>",
]
THINK = "<|channel|>analysis<|message|>Let me see: a < b, <|x|> too.<|end|><|start|>assistant"
CALL = '<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"x": 1, "y": 2}<|call|>'
# (model text, reasoning, content, calls as (name, arguments, complete))
CASES = [
    (
        f"{THINK}<|channel|>final<|message|>Paris.<|return|>",
        "Let me see: a < b, <|x|> too.",
        "Paris.",
        [],
    ),
    (f"{THINK}{CALL}", "Let me see: a < b, <|x|> too.", "", [("add", '{"x": 1, "y": 2}', True)]),
    # The recipient before the channel, as gpt-oss's template writes past calls.
    (
        ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}<|call|>',
        "",
        "",
        [("get_weather", '{"city": "Oslo"}', True)],
    ),
    # A preamble to the user in the commentary channel, then the call.
    (
        f"<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant{CALL}",
        "",
        "Checking.",
        [("add", '{"x": 1, "y": 2}', True)],
    ),
    # Cut by max_tokens inside the call: its arguments so far, not complete.
    (
        '<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"x": 1',
        "",
        "",
        [("add", '{"x": 1', False)],
    ),
    ("<|channel|>analysis<|message|>still thinking", "still thinking", "", []),
    # A built-in tool's call (gpt-oss's browser) is the model's own work: reasoning.
    (
        '<|channel|>analysis to=browser.search code<|message|>{"query": "x"}<|call|>',
        '{"query": "x"}',
        "",
        [],
    ),
    ("No markup at all.", "", "No markup at all.", []),
    ("<|channel|>fin", "", "", []),  # a header cut short is markup, not text
    ("<|channel|>final<|message|>A<|start|>assistant<|channel|>final<|message|>B", "", "AB", []),
    ("", "", "", []),
]


def whole(text: str) -> Answer:
    return parse_answer(text, HarmonySplit())


def streamed(pieces: list[str], cut: bool = False) -> Answer:
    stream, answer = AnswerStream(HarmonySplit()), Answer()
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        answer.add(stream.feed(piece, final=last, cut=cut and last))
    return answer


def parts(answer: Answer) -> tuple:
    return answer.reasoning, answer.content, [(c.name, c.arguments) for c in answer.calls]


@pytest.mark.parametrize(("text", "reasoning", "content", "calls"), CASES)
def test_whole_answer_splits(text, reasoning, content, calls) -> None:
    split = HarmonySplit()
    stream = AnswerStream(split)
    answer = Answer()
    answer.add(stream.feed(text, final=True))
    assert parts(answer) == (reasoning, content, [c[:2] for c in calls])
    assert [c.id for c in answer.calls] == split.ids
    assert split.complete == [c[2] for c in calls]
    assert stream.has_calls == bool(calls)
    assert stream.calls_complete == all(c[2] for c in calls)


@pytest.mark.parametrize("text", [c[0] for c in CASES])
def test_streamed_at_every_split_point_equals_whole(text: str) -> None:
    expected = parts(whole(text))
    for i in range(len(text) + 1):
        assert parts(streamed([text[:i], text[i:]])) == expected, i


@pytest.mark.parametrize("text", [c[0] for c in CASES[:4]])
def test_streamed_at_every_pair_of_points_equals_whole(text: str) -> None:
    expected = parts(whole(text))
    for i, j in itertools.combinations(range(len(text) + 1), 2):
        assert parts(streamed([text[:i], text[i:j], text[j:]])) == expected, (i, j)
    assert parts(streamed(list(text))) == expected


def test_a_marker_begun_at_a_cut_is_not_text() -> None:
    assert streamed(["<|channel|>final<|message|>Paris<|ret"], cut=True).content == "Paris"
    assert streamed(["<|channel|>final<|message|>Paris<|ret"]).content == "Paris<|ret"


def test_a_long_body_streamed_in_small_pieces_is_read_once(monkeypatch) -> None:
    """Each delta is searched for markers from where the last search stopped."""
    read = 0
    closer = HarmonySplit._closer

    def counting(self, text):
        nonlocal read
        read += len(text) - self.search
        return closer(self, text)

    monkeypatch.setattr(HarmonySplit, "_closer", counting)
    text = "<|channel|>analysis<|message|>" + "a <b |c> <|d " * 500 + "<|end|>"
    split, reasoning = HarmonySplit(), ""
    for i in range(0, len(text), 3):
        reasoning += split.feed(text[i : i + 3], final=False)[0]
    assert reasoning == "a <b |c> <|d " * 500
    assert read <= 2 * len(text)


def test_cli_chat_dims_the_analysis_channel() -> None:
    out = io.StringIO()
    out.isatty = lambda: True
    shown = ThinkingDisplay(HarmonySplit(), out)
    for piece in ["<|channel|>analysis<|mess", "age|>Plan.<|end|><|start|>assistant<|ch", "an"]:
        shown.write(piece)
    shown.write("nel|>final<|message|>Paris.<|return|>", final=True)
    assert shown.content == "Paris."
    assert out.getvalue() == f"{ThinkingDisplay.DIM}Plan.{ThinkingDisplay.PLAIN}\n\nParis."


def test_reasoning_tokens_end_at_the_last_analysis_message() -> None:
    end = 7
    split = HarmonySplit()
    split.feed("<|channel|>commentary<|message|>hi<|end|><|start|>assistant", False)
    split.feed("<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>final", False)
    ids = [1, 2, 3, end, 4, 5, 6, 8, end, 4, 5, 9]  # the second <|end|> closes the analysis
    assert split.reasoning_tokens(ids, end) == 9
    assert HarmonySplit().reasoning_tokens(ids, end) == 0
    thinking = HarmonySplit()
    thinking.feed("<|channel|>analysis<|message|>cut here", False)
    assert thinking.reasoning_tokens(ids, end) == len(ids)


# -- the chat template --------------------------------------------------------------------------


def test_gpt_oss_template_is_detected_and_others_are_not() -> None:
    assert reasoning_format("auto", GPT_OSS) is HARMONY
    assert tool_format("auto", GPT_OSS) is HARMONY_CALLS
    assert reasoning_format("openai_gptoss", None) is HARMONY
    assert tool_format("openai", None) is HARMONY_CALLS
    for name in ("Qwen-Qwen3-0.6B.jinja", "meta-llama-Llama-3.3-70B-Instruct.jinja"):
        other = (TEMPLATES / name).read_text()
        assert reasoning_format("auto", other) is not HARMONY
        assert tool_format("auto", other) is not HARMONY_CALLS


def test_effort_and_thinking_off() -> None:
    def system(effort):
        kwargs = template_kwargs(GPT_OSS, None, None, effort)
        messages = [{"role": "user", "content": "Hi"}]
        return render_chat_template(GPT_OSS, messages, True, "", "", **kwargs)

    assert "Reasoning: high\n" in system("high") and "Reasoning: low\n" in system("minimal")
    assert "Reasoning: medium\n" in system(None)  # the template's default
    assert system(None).endswith("<|start|>assistant")
    # chat_template_kwargs win over the request's field, as for enable_thinking.
    assert template_kwargs(GPT_OSS, None, {"reasoning_effort": "low"}, "high") == {
        "reasoning_effort": "low"
    }
    suffix, state = plan_thinking(HARMONY, system(None), enable_thinking=False)
    assert (suffix, state) == (
        "<|channel|>analysis<|message|><|end|><|start|>assistant",
        "closed",
    )
    assert plan_thinking(HARMONY, system(None), None) == ("", "maybe")


def test_a_tool_round_in_the_history() -> None:
    """An earlier call's reasoning (`reasoning_content`, as clients send it back) is rendered
    while its turn is unfinished, and dropped once a final answer follows, as the template
    does; the tool's result is rendered as a message from the function."""
    tool = {"type": "function", "function": {"name": "add", "description": "Adds."}}
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"x": 1}'}}
    history = [
        {"role": "user", "content": "1 + 1?"},
        {"role": "assistant", "content": "", "reasoning_content": "Use add.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "2"},
    ]

    def render(messages):
        messages, extra = template_inputs(messages, [tool], GPT_OSS)
        return render_chat_template(GPT_OSS, messages, True, "", "", **extra)

    open_turn = render(history)
    assert (
        "<|start|>assistant<|channel|>analysis<|message|>Use add.<|end|>"
        '<|start|>assistant to=functions.add<|channel|>commentary json<|message|>{"x": 1}<|call|>'
        '<|start|>functions.add to=assistant<|channel|>commentary<|message|>"2"<|end|>'
    ) in open_turn
    assert "type add = () => any;" in open_turn
    done = render([*history, {"role": "assistant", "content": "2."}, *history[:1]])
    assert "Use add." not in done and "<|channel|>final<|message|>2.<|end|>" in done


# -- the grammars -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def harmony_tok(default_gguf_path):
    tok = Tokenizer.from_gguf(gguf.GGUFReader(default_gguf_path))
    tok.backend.add_special_tokens(MARKERS)
    return tok, llguidance.LLTokenizer(tok.backend.to_str(), eos_token=tok.eos_token_ids)


def test_markers_are_single_special_tokens(harmony_tok) -> None:
    tok = harmony_tok[0]
    assert set(MARKERS) <= tok.added_tokens
    assert len(tok.encode(CALL, add_special_tokens=False)) < len(CALL) // 2


def test_what_the_call_grammar_accepts(harmony_tok) -> None:
    tokens = harmony_tok[0].added_tokens
    add = HARMONY_CALLS.calls_text([("add", {"x": 1, "y": 2.5})]).removeprefix("<|start|>assistant")
    weather = HARMONY_CALLS.calls_text([("get_weather", {"city": "Paris"})])
    weather = weather.removeprefix("<|start|>assistant")
    bad = add.replace("2.5", '"two"')
    final = "<|channel|>final<|message|>The answer is 42.<|return|>"
    cases = {  # text: (auto, required, none)
        add: (True, True, False),
        weather: (True, True, False),
        bad: (False, False, False),
        final: (True, False, True),
        "The answer is 42.": (False, False, False),
        add.replace("add", "mul"): (False, False, False),
    }
    for text, expected in cases.items():
        for choice, want in zip(("auto", "required", "none"), expected, strict=True):
            grammar = HARMONY_CALLS.grammar(FUNCTIONS, choice, False, tokens=tokens)
            assert accepts(harmony_tok, grammar, text) == want, (choice, text)
    named = HARMONY_CALLS.grammar(FUNCTIONS[1:], "required", False, tokens=tokens)
    assert accepts(harmony_tok, named, add) and not accepts(harmony_tok, named, weather)
    answer = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    with_json = HARMONY_CALLS.grammar(FUNCTIONS, "auto", False, answer, tokens)
    assert accepts(harmony_tok, with_json, '<|channel|>final<|message|>{"city":"Rome"}<|return|>')
    assert not accepts(harmony_tok, with_json, final) and accepts(harmony_tok, with_json, add)


def test_what_the_thinking_grammar_accepts(harmony_tok) -> None:
    tok = harmony_tok[0]
    think = "<|channel|>analysis<|message|>Hmm.<|end|><|start|>assistant"
    final = "<|channel|>final<|message|>Paris.<|return|>"
    free = harmony_grammar(tok, False, None, None, False)
    assert accepts(harmony_tok, free, think + final) and accepts(harmony_tok, free, final)
    assert not accepts(harmony_tok, free, think) and not accepts(harmony_tok, free, "Paris.")
    off = harmony_grammar(tok, True, None, None, False)
    assert accepts(harmony_tok, off, final) and not accepts(harmony_tok, off, think + final)
    schema = {"json_schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}
    as_json = harmony_grammar(tok, False, schema, None, False)
    assert accepts(harmony_tok, as_json, think + '<|channel|>final<|message|>{"a":1}<|return|>')
    assert not accepts(harmony_tok, as_json, think + final)
    calls = HARMONY_CALLS.grammar(FUNCTIONS, "required", False, tokens=tok.added_tokens)
    with_calls = harmony_grammar(tok, False, {"grammar": calls}, 5, True)
    call = HARMONY_CALLS.calls_text([("add", {"x": 1, "y": 2})]).removeprefix("<|start|>assistant")
    assert accepts(harmony_tok, with_calls, think + call) and accepts(harmony_tok, with_calls, call)
    assert not accepts(harmony_tok, with_calls, think + final)
