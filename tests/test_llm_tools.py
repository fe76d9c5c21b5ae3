"""LLM.chat(messages, tools=...): calls constrained and parsed into each completion's
tool_calls, on the default model (generic tool format) and with each family's real chat
template swapped in (its own format)."""

import json
from pathlib import Path

import jsonschema
import pytest

from tinyllm import SamplingParams
from tinyllm.engine.structured_output.params import StructuredOutputsParams
from tinyllm.entrypoints import cli
from tinyllm.entrypoints.llm_options import llm_configs
from tinyllm.text.tool_calls import ToolCallStream
from tinyllm.text.tool_formats import GENERIC, tool_format

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


TEMPLATES = Path(__file__).parent / "data" / "templates"
FAMILIES = [
    "meta-llama-Llama-3.3-70B-Instruct.jinja",
    "mistralai-Mistral-Nemo-Instruct-2407.jinja",
    "unsloth-mistral-Devstral-Small-2507.jinja",
    "Qwen-Qwen3-0.6B.jinja",
]


@pytest.fixture
def family(default_llm, request):
    """The default model with a family's real chat template swapped in, and its tool format."""
    template = (TEMPLATES / request.param).read_text()
    tokenizer = default_llm.tokenizer
    saved = tokenizer.chat_template, default_llm.tool_format
    tokenizer.chat_template = template
    default_llm.tool_format = tool_format("auto", template)
    yield default_llm
    tokenizer.chat_template, default_llm.tool_format = saved


@pytest.mark.parametrize("family", FAMILIES, indirect=True)
def test_each_familys_format_calls_validate_and_stream_the_same(family):
    named = {"type": "function", "function": {"name": "get_weather"}}
    # Greedy, and sampled hot: random token sequences the grammar must keep valid.
    params = [GREEDY, *(SamplingParams(temperature=1.5, seed=s, max_tokens=96) for s in range(3))]
    for choice in ("required", named):
        outs = family.chat([ASK] * 4, params, use_tqdm=False, tools=TOOLS, tool_choice=choice)
        for completion in (out.outputs[0] for out in outs):
            _check_calls_and_their_stream(family, completion)


def _check_calls_and_their_stream(family, completion) -> None:
    fmt = family.tool_format
    assert completion.finish_reason == "stop" and completion.tool_calls, completion.text
    for call in completion.tool_calls:
        assert call.name == "get_weather" and call.complete
        jsonschema.validate(json.loads(call.arguments), TOOLS[0]["function"]["parameters"])
    # Streamed token by token, the calls reassemble to the whole parse.
    stream, sent, calls = ToolCallStream(fmt.scan), "", {}
    ids = completion.token_ids
    for k in range(1, len(ids) + 1):
        text = family.tokenizer.decode(ids[:k])
        content, deltas = stream.feed(text[len(sent) :], final=k == len(ids))
        sent = text
        assert content == ""
        for d in deltas:
            calls.setdefault(d.index, [d.name, ""])[1] += d.arguments
    assert sent == completion.text
    assert [tuple(c) for c in calls.values()] == [
        (c.name, c.arguments) for c in completion.tool_calls
    ]


PYDANTIC_NESTED = {
    "$defs": {
        "User": {
            "properties": {"name": {"maxLength": 16, "type": "string"}},
            "required": ["name"],
            "type": "object",
        }
    },
    "properties": {"user": {"$ref": "#/$defs/User"}, "days": {"enum": [1, 2, 3]}},
    "required": ["user", "days"],
    "type": "object",
}


def test_parameters_with_defs_and_a_response_format_beside_the_tools(default_llm):
    tools = [{"type": "function", "function": {"name": "greet", "parameters": PYDANTIC_NESTED}}]
    out = default_llm.chat(ASK, GREEDY, use_tqdm=False, tools=tools, tool_choice="required")
    (call,) = out[0].outputs[0].tool_calls
    jsonschema.validate(json.loads(call.arguments), PYDANTIC_NESTED)
    answer = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}}}
    json_params = SamplingParams(
        temperature=0, max_tokens=64, structured_outputs=StructuredOutputsParams(json=answer)
    )
    completion = default_llm.chat(ASK, json_params, use_tqdm=False, tools=TOOLS)[0].outputs[0]
    if completion.tool_calls:
        assert all(c.complete for c in completion.tool_calls)
    else:
        jsonschema.validate(json.loads(completion.text), answer)
    with pytest.raises(ValueError, match="only json or json_object combines with calls"):
        regex = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+"))
        default_llm.chat(ASK, regex, use_tqdm=False, tools=TOOLS)


def test_a_call_cut_by_max_tokens_has_no_nameless_call(default_llm):
    for n in (3, 8):
        short = SamplingParams(temperature=0, max_tokens=n)
        out = default_llm.chat(ASK, short, use_tqdm=False, tools=TOOLS, tool_choice="required")
        completion = out[0].outputs[0]
        assert completion.finish_reason == "length"
        assert all(c.name == "get_weather" and not c.complete for c in completion.tool_calls)


def test_the_tool_call_parser_option_and_flag():
    own, _, _ = llm_configs({"tool_call_parser": "llama3_json"})
    assert own.tool_call_parser == "llama3_json"
    with pytest.raises(ValueError, match="tool_call_parser: 'nope' is not one of auto"):
        llm_configs({"tool_call_parser": "nope"})
    serve = next(p for p in cli.iter_parsers(cli.build_parser()) if p.prog == "tinyllm serve")
    assert serve.parse_args(["--tool-call-parser", "mistral"]).tool_call_parser == "mistral"
    assert serve.parse_args([]).tool_call_parser == "auto"


def test_the_default_model_uses_the_generic_format(default_llm):
    assert default_llm.tool_format is GENERIC
