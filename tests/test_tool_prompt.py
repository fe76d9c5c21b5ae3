"""Tools into the chat template: a template that reads `tools` gets them (and tool calls with
dict arguments); the default model's, which does not, gets the generic format."""

import json
from pathlib import Path

import gguf
import pytest

from tinyllm.text.tokenizer import Tokenizer
from tinyllm.text.tool_formats import tool_format
from tinyllm.text.tool_prompt import template_reads_tools

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CALLED = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        }
    ],
}
EXCHANGE = [
    {"role": "user", "content": "Weather in Paris?"},
    CALLED,
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "sunny"},
]
# A tool-aware template of the Hermes kind, small enough to read.
HERMES = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>\n"
    "{% endif %}{% for m in messages %}[{{ m.role }}]"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "{{ c.function.name }}({{ c.function.arguments.city }}){% endfor %}"
    "{% else %}{{ m.content }}{% endif %}\n{% endfor %}"
)


@pytest.fixture(scope="module")
def smollm(default_gguf_path) -> Tokenizer:
    return Tokenizer.from_gguf(gguf.GGUFReader(default_gguf_path))


def test_which_templates_read_tools(smollm):
    assert not template_reads_tools(smollm.chat_template)
    assert template_reads_tools(HERMES)


def test_generic_format_on_the_default_model(smollm):
    text, ids = smollm.encode_chat(
        [{"role": "system", "content": "Be brief."}, *EXCHANGE], tools=TOOLS
    )
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert json.dumps(TOOLS[0]) in text  # one JSON line per tool
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call><|im_end|>'
    ) in text
    # Both results of the turn in one user message.
    assert (
        "<|im_start|>user\n<tool_response>\n18 C\n</tool_response>\n"
        "<tool_response>\nsunny\n</tool_response><|im_end|>"
    ) in text
    assert text.endswith("<|im_start|>assistant\n")
    assert ids == smollm.encode(text, add_special_tokens=False)


def test_generic_format_without_a_system_message(smollm):
    text, _ = smollm.encode_chat([{"role": "user", "content": "Hi"}], tools=TOOLS)
    # The tools are the system message (instead of the template's default one).
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert "SmolLM" not in text


def test_a_template_that_reads_tools_gets_them(smollm):
    tok = Tokenizer(smollm.backend, bos_token_id=None, eos_token_ids=[0], chat_template=HERMES)
    text, _ = tok.encode_chat(EXCHANGE, tools=TOOLS)
    assert text.startswith("<tools>get_weather;</tools>\n")
    # Arguments reach the template as a dict, as Hugging Face templates expect.
    assert text.endswith("[assistant]get_weather(Paris)[tool]18 C[tool]sunny")


def test_arguments_that_are_not_json_are_refused(smollm):
    bad = {
        **CALLED,
        "tool_calls": [
            {
                **CALLED["tool_calls"][0],
                "function": {"name": "get_weather", "arguments": "{city: Paris"},
            }
        ],
    }
    with pytest.raises(ValueError, match=r"tool_calls\.0\.function\.arguments is not JSON"):
        smollm.encode_chat([EXCHANGE[0], bad], tools=TOOLS)


TEMPLATES = Path(__file__).parent / "data" / "templates"
# Each family's template with a whole tool round: how it writes the call in the history.
WRITTEN = {
    "meta-llama-Llama-3.3-70B-Instruct.jinja": '{"name": "get_weather", "parameters": {"city": '
    '"Paris"}}',
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": '[TOOL_CALLS][{"name": "get_weather", '
    '"arguments": {"city": "Paris"}, "id": "a1b2c3d4e"}]',
    "unsloth-mistral-Devstral-Small-2507.jinja": '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
    "Qwen-Qwen3-0.6B.jinja": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}',
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja": '"name": "get_weather"',
}


@pytest.mark.parametrize("name", WRITTEN)
def test_each_familys_template_renders_a_tool_round(smollm, name):
    # The call's message as clients send it back: content null (or left out), arguments text.
    # Mistral's templates want 9-character call ids (the ids its format gives).
    call = {**CALLED["tool_calls"][0], "id": "a1b2c3d4e"}
    for content in ({"content": None}, {}):
        called = {"role": "assistant", **content, "tool_calls": [call]}
        result = {"role": "tool", "tool_call_id": "a1b2c3d4e", "content": "18 C"}
        tok = Tokenizer(
            smollm.backend,
            bos_token_id=None,
            eos_token_ids=[0],
            chat_template=(TEMPLATES / name).read_text(),
        )
        text, _ = tok.encode_chat([EXCHANGE[0], called, result], tools=TOOLS)
        assert WRITTEN[name] in text and "18 C" in text and "None" not in text


def test_a_named_format_on_a_template_without_tools_writes_its_own_calls(smollm):
    llama = tool_format("llama3_json")
    text, _ = smollm.encode_chat(EXCHANGE, tools=TOOLS, tool_format=llama)
    assert llama.instruction in text and "<tool_call>" not in text
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}' in text
