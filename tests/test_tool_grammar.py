"""The tool-call grammars, run by llguidance over the default model's tokens: what each
tool_choice lets through and what it refuses."""

import gguf
import llguidance
import pytest

from tinyllm.text.tokenizer import Tokenizer
from tinyllm.text.tool_grammar import check_parameters, tool_grammar

FUNCTIONS = [
    {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city"],
        },
    },
    {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
            "required": ["x", "y"],
        },
    },
]
ADD = '<tool_call>\n{"name": "add", "arguments": {"x": 1, "y": 2.5}}\n</tool_call>'
WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TEXT = "The answer is 42."


@pytest.fixture(scope="module")
def tokenizer(default_gguf_path):
    tok = Tokenizer.from_gguf(gguf.GGUFReader(default_gguf_path))
    return tok, llguidance.LLTokenizer(tok.backend.to_str(), eos_token=tok.eos_token_ids)


def accepts(tokenizer, grammar: str, text: str) -> bool:
    """Whether the grammar lets the model write exactly `text` and then stop."""
    tok, ll = tokenizer
    matcher = llguidance.LLMatcher(ll, grammar)
    assert not matcher.is_error(), matcher.get_error()
    ids = tok.encode(text, add_special_tokens=False)
    return matcher.consume_tokens(ids) and matcher.is_accepting()


CASES = {
    # text: (auto, required, none), parallel calls allowed
    TEXT: (True, False, True),
    ADD: (True, True, False),
    f"{WEATHER}\n{ADD}": (True, True, False),
    f"Let me check.\n{WEATHER}": (True, False, False),
    '<tool_call>\n{"name": "multiply", "arguments": {"x": 1, "y": 2}}\n</tool_call>': (
        False,
        False,
        False,
    ),
    '<tool_call>\n{"name": "add", "arguments": {"x": "one", "y": 2}}\n</tool_call>': (
        False,
        False,
        False,
    ),
    '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>': (False, False, False),
    f"{ADD} and some text after": (False, False, False),
    # Arguments hold the declared parameters only (the schemas do not say otherwise).
    '<tool_call>\n{"name": "add", "arguments": {"x": 1, "y": 2, "z": 3}}\n</tool_call>': (
        False,
        False,
        False,
    ),
    "Sure <tool_call> I will not call after all": (False, False, False),
}


@pytest.mark.parametrize("text", CASES)
def test_what_each_tool_choice_accepts(tokenizer, text):
    for choice, expected in zip(("auto", "required", "none"), CASES[text], strict=True):
        grammar = tool_grammar(FUNCTIONS, choice, parallel=True)
        assert accepts(tokenizer, grammar, text) == expected, choice


def test_one_call_without_parallel_calls_and_a_named_function(tokenizer):
    single = tool_grammar(FUNCTIONS, "required", parallel=False)
    assert accepts(tokenizer, single, ADD)
    assert not accepts(tokenizer, single, f"{ADD}\n{ADD}")
    named = tool_grammar(FUNCTIONS[1:], "required", parallel=False)
    assert accepts(tokenizer, named, ADD) and not accepts(tokenizer, named, WEATHER)


def test_a_parameters_schema_that_does_not_compile_names_its_function():
    check_parameters(FUNCTIONS)
    bad = {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "strin"}}}}
    with pytest.raises(ValueError, match=r"tools\.1\.function\.parameters \(f\): .*strin"):
        check_parameters([FUNCTIONS[0], bad])


# What Pydantic writes for nested models: definitions under $defs, used by $ref.
NESTED = {
    "name": "greet",
    "parameters": {
        "$defs": {
            "User": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "pet": {"$ref": "#/$defs/Pet"}},
                "required": ["name"],
            },
            "Pet": {"enum": ["cat", "dog"]},
        },
        "type": "object",
        "properties": {"user": {"$ref": "#/$defs/User"}},
        "required": ["user"],
    },
}
# The older `definitions`, and a recursive schema whose `$ref` is the root itself.
OLDER = {
    "name": "tree",
    "parameters": {
        "definitions": {"Leaf": {"type": "integer"}},
        "type": "object",
        "properties": {
            "value": {"$ref": "#/definitions/Leaf"},
            "children": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2},
        },
        "required": ["value"],
    },
}


def _call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def test_defs_and_refs_of_each_function_are_kept_apart(tokenizer):
    # The same definition name in two functions means two things.
    other = {
        "name": "other",
        "parameters": {
            "$defs": {"User": {"type": "integer"}},
            "type": "object",
            "properties": {"user": {"$ref": "#/$defs/User"}},
            "required": ["user"],
        },
    }
    functions = [NESTED, OLDER, other]
    check_parameters(functions)
    grammar = tool_grammar(functions, "required", parallel=False)
    for text, expected in [
        (_call("greet", '{"user": {"name": "Ann", "pet": "cat"}}'), True),
        (_call("greet", '{"user": {"name": "Ann", "pet": "cow"}}'), False),
        (_call("greet", '{"user": 7}'), False),
        (_call("other", '{"user": 7}'), True),
        (_call("other", '{"user": {"name": "Ann"}}'), False),
        (_call("tree", '{"value": 1, "children": [{"value": 2}]}'), True),
        (_call("tree", '{"value": 1, "children": [{"value": "x"}]}'), False),
    ]:
        assert accepts(tokenizer, grammar, text) == expected, text
