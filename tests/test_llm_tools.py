"""LLM.chat(messages, tools=...): calls constrained and parsed into each completion's
tool_calls, on the default model (generic tool format)."""

import json

import jsonschema
import pytest

from tinyllm import SamplingParams

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 24}},
                "required": ["city"],
            },
        },
    }
]
ASK = [{"role": "user", "content": "What is the weather in Rome?"}]
GREEDY = SamplingParams(temperature=0, max_tokens=64)


def test_required_gives_parsed_calls_that_validate(default_llm):
    out = default_llm.chat(ASK, GREEDY, use_tqdm=False, tools=TOOLS, tool_choice="required")[0]
    completion = out.outputs[0]
    assert completion.finish_reason == "stop" and completion.tool_calls
    for call in completion.tool_calls:
        assert call.name == "get_weather" and call.complete
        jsonschema.validate(json.loads(call.arguments), TOOLS[0]["function"]["parameters"])
    assert completion.text.startswith("<tool_call>\n")  # the text as generated


def test_none_gives_no_calls_and_bad_tools_are_named(default_llm):
    short = SamplingParams(temperature=0, max_tokens=16)
    out = default_llm.chat(ASK, short, use_tqdm=False, tools=TOOLS, tool_choice="none")[0]
    assert out.outputs[0].tool_calls is None and "<tool_call>" not in out.text
    with pytest.raises(ValueError, match="tool_choice: no function 'nope'"):
        named = {"type": "function", "function": {"name": "nope"}}
        default_llm.chat(ASK, GREEDY, use_tqdm=False, tools=TOOLS, tool_choice=named)
    with pytest.raises(ValueError, match=r"tools\.0: give"):
        default_llm.chat(ASK, GREEDY, use_tqdm=False, tools=[{"name": "f"}])
