"""Tool-call formats per model family (tinyllm.text.tool_formats): detection from real chat
templates (tests/data/templates), each format's grammar run by llguidance over the default
model's tokens, and its parse, whole and streamed in any pieces, reassembling the same."""

import json
from pathlib import Path

import gguf
import llguidance
import pytest

from tests.test_tool_grammar import FUNCTIONS
from tinyllm.text import tool_calls
from tinyllm.text.tokenizer import Tokenizer
from tinyllm.text.tool_calls import ToolCallStream, parse_tool_calls
from tinyllm.text.tool_formats import (
    GENERIC,
    TOOL_CALL_PARSERS,
    tool_format,
)
from tinyllm.text.tool_formats.hermes import HERMES
from tinyllm.text.tool_formats.llama3_json import LLAMA3_JSON
from tinyllm.text.tool_formats.mistral import MISTRAL_V3, MISTRAL_V11

TEMPLATES = Path(__file__).parent / "data" / "templates"
DETECTED = {
    "meta-llama-Llama-3.3-70B-Instruct.jinja": LLAMA3_JSON,
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": MISTRAL_V3,
    "unsloth-mistral-Devstral-Small-2507.jinja": MISTRAL_V11,
    "Qwen-Qwen3-0.6B.jinja": HERMES,
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja": HERMES,
}
WEATHER = ("get_weather", {"city": "Paris"})
ADD = ("add", {"x": 1, "y": 2.5})
FORMATS = [HERMES, LLAMA3_JSON, MISTRAL_V3, MISTRAL_V11]


@pytest.fixture(scope="module")
def smollm(default_gguf_path):
    tok = Tokenizer.from_gguf(gguf.GGUFReader(default_gguf_path))
    return tok, llguidance.LLTokenizer(tok.backend.to_str(), eos_token=tok.eos_token_ids)


def accepts(smollm, grammar: str, text: str) -> bool:
    """Whether the grammar lets the model write exactly `text` and then stop."""
    tok, ll = smollm
    matcher = llguidance.LLMatcher(ll, grammar)
    assert not matcher.is_error(), matcher.get_error()
    return matcher.consume_tokens(tok.encode(text, add_special_tokens=False)) and (
        matcher.is_accepting()
    )


@pytest.mark.parametrize("name", DETECTED)
def test_each_real_template_gets_its_familys_format(name):
    assert tool_format("auto", (TEMPLATES / name).read_text()) is DETECTED[name]


def test_the_default_models_template_and_none_get_the_generic_format(smollm):
    assert tool_format("auto", smollm[0].chat_template) is GENERIC is HERMES
    assert tool_format("auto", None) is GENERIC


def test_a_named_parser_overrides_the_template():
    llama = (TEMPLATES / "meta-llama-Llama-3.3-70B-Instruct.jinja").read_text()
    devstral = (TEMPLATES / "unsloth-mistral-Devstral-Small-2507.jinja").read_text()
    assert tool_format("hermes", llama) is HERMES
    assert tool_format("llama3_json", None) is LLAMA3_JSON
    assert tool_format("mistral", devstral) is MISTRAL_V11
    assert tool_format("mistral", llama) is MISTRAL_V3
    assert set(TOOL_CALL_PARSERS) == {"auto", "hermes", "llama3_json", "mistral", "openai"}
    with pytest.raises(ValueError, match="tool_call_parser: 'nope' is not one of auto"):
        tool_format("nope")


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: type(f).__name__)
def test_what_each_formats_grammar_accepts(smollm, fmt):
    one, two = fmt.calls_text([ADD]), fmt.calls_text([WEATHER, ADD])
    bad_args = fmt.calls_text([("add", {"x": "one", "y": 2})])
    unknown = fmt.calls_text([("multiply", {"x": 1, "y": 2})])
    extra = fmt.calls_text([("add", {"x": 1, "y": 2, "z": 3})])
    text = "The answer is 42."
    cases = {  # text: (auto, required, none), parallel calls allowed
        text: (True, False, True),
        one: (True, True, False),
        two: (True, True, False),
        bad_args: (False, False, False),
        unknown: (False, False, False),
        extra: (False, False, False),
        f"{one} and some text after": (False, False, False),
    }
    if fmt is not LLAMA3_JSON:  # Llama's calls are the whole answer; the others follow text
        cases[f"Let me check.\n{one}"] = (True, False, False)
    for case, expected in cases.items():
        for choice, want in zip(("auto", "required", "none"), expected, strict=True):
            grammar = fmt.grammar(FUNCTIONS, choice, parallel=True)
            assert accepts(smollm, grammar, case) == want, (choice, case)
    single = fmt.grammar(FUNCTIONS, "required", parallel=False)
    assert accepts(smollm, single, one) and not accepts(smollm, single, two)
    named = fmt.grammar(FUNCTIONS[1:], "required", parallel=False)
    assert accepts(smollm, named, one) and not accepts(smollm, named, fmt.calls_text([WEATHER]))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: type(f).__name__)
def test_a_response_format_beside_the_tools(smollm, fmt):
    answer = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    auto = fmt.grammar(FUNCTIONS, "auto", parallel=False, answer=answer)
    required = fmt.grammar(FUNCTIONS, "required", parallel=False, answer=answer)
    # The answer's JSON is compact, as structured output writes it.
    call, json_answer = fmt.calls_text([ADD]), '{"city":"Rome"}'
    assert accepts(smollm, auto, call) and accepts(smollm, auto, json_answer)
    assert not accepts(smollm, auto, "Rome.") and not accepts(smollm, auto, '{"town":"Rome"}')
    assert accepts(smollm, required, call) and not accepts(smollm, required, json_answer)


def _stream(fmt, text: str, step: int, cut: bool = False):
    stream = ToolCallStream(fmt.scan)
    content, calls = "", {}
    pieces = [text[i : i + step] for i in range(0, len(text), step)] or [""]
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        new, deltas = stream.feed(piece, final=last, cut=cut and last)
        content += new
        for d in deltas:
            if d.name is not None:
                calls[d.index] = [d.name, ""]
            else:
                calls[d.index][1] += d.arguments
    return content, [tuple(c) for c in calls.values()]


def _texts(fmt) -> list[str]:
    calls = [fmt.calls_text([WEATHER]), fmt.calls_text([WEATHER, ADD])]
    quoted = fmt.calls_text([("note", {"text": "a } ] [TOOL_CALLS] </tool_call> ; in it"})])
    texts = [*calls, quoted, "Just text, with a { and a [ and a <tool but no call.\n"]
    if fmt is not LLAMA3_JSON:
        texts.append(f"Let me check.\n{calls[1]}")
    return texts


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: type(f).__name__)
def test_streamed_calls_reassemble_to_the_whole_parse(fmt):
    for text in _texts(fmt):
        whole = parse_tool_calls(text, scan=fmt.scan)
        if not text.startswith("Just text"):
            assert whole.calls and all(c.complete for c in whole.calls), text
            for c in whole.calls:
                json.loads(c.arguments)
        expected = (whole.content, [(c.name, c.arguments) for c in whole.calls])
        for step in (1, 2, 3, 5, 8, len(text)):
            assert _stream(fmt, text, step) == expected, (text, step)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: type(f).__name__)
def test_calls_cut_anywhere_leave_no_markup_in_the_content(fmt):
    text = "Sure." + ("" if fmt is LLAMA3_JSON else " ") + fmt.calls_text([WEATHER])
    if fmt is LLAMA3_JSON:
        text = fmt.calls_text([WEATHER])
    for end in range(len(text) + 1):
        piece = text[:end]
        whole = parse_tool_calls(piece, cut=True, scan=fmt.scan)
        assert "Sure.".startswith(whole.content), piece
        assert all(c.name == "get_weather" for c in whole.calls)
        complete = [c.complete for c in whole.calls]
        if end == len(text):
            assert complete == [True]
        elif end <= text.rindex("}"):  # cut inside the call: never complete
            assert not any(complete), piece
        expected = (whole.content, [(c.name, c.arguments) for c in whole.calls])
        for step in (1, 4):
            assert _stream(fmt, piece, step, cut=True) == expected, piece


def test_mistral_call_ids_are_nine_letters_and_digits():
    (call,) = parse_tool_calls(MISTRAL_V11.calls_text([ADD]), scan=MISTRAL_V11.scan).calls
    assert len(call.id) == 9 and call.id.isalnum()
    stream = ToolCallStream(MISTRAL_V3.scan)
    _, deltas = stream.feed(MISTRAL_V3.calls_text([ADD]), final=True)
    assert len(deltas[0].id) == 9 and deltas[0].id.isalnum()


def test_llama_calls_after_the_python_tag_and_text_that_is_not_a_call():
    text = '<|python_tag|>{"name": "add", "parameters": {"x": 1, "y": 2}}'
    (call,) = parse_tool_calls(text, scan=LLAMA3_JSON.scan).calls
    assert (call.name, call.arguments, call.complete) == ("add", '{"x": 1, "y": 2}', True)
    prose = 'It is {"name": "add"} in JSON.'
    assert parse_tool_calls(prose, scan=LLAMA3_JSON.scan).content == prose
    assert parse_tool_calls('{"na', final=False, scan=LLAMA3_JSON.scan).content == ""


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: type(f).__name__)
def test_a_long_call_streamed_in_small_pieces_is_read_once(fmt, monkeypatch):
    # Every format reads a call's JSON values with _Value, which goes on from where it stopped.
    read = 0
    end = tool_calls._Value.end

    def counting_end(self, text, stop):
        nonlocal read
        read += stop - self.next
        return end(self, text, stop)

    monkeypatch.setattr(tool_calls._Value, "end", counting_end)
    arguments = {"text": 'a "quoted" word, {braces} [and] \\ ' * 150, "n": [1, 2.5]}
    text = fmt.calls_text([("write", arguments)])
    assert len(text) > 5000
    stream, pieces = ToolCallStream(fmt.scan), [text[i : i + 3] for i in range(0, len(text), 3)]
    sent = ""
    for i, piece in enumerate(pieces):
        sent += "".join(d.arguments for d in stream.feed(piece, final=i == len(pieces) - 1)[1])
    assert json.loads(sent) == arguments
    assert read <= len(text) + 100
