"""gpt-oss's harmony format through the real server and the official openai client: a tiny
random gpt-oss checkpoint whose vocabulary (the default model's) has harmony's markers as
special tokens and whose chat template is gpt-oss's (openai-gpt-oss-120b.jinja in
tests/data/templates). Random weights write garbage, so the tests steer them: a bias towards
the word `analysis` (which, where the grammar lets the model choose a channel, picks the
analysis channel), a thinking budget that closes it, forced tool_choice and response_format.
The reasoning, content and calls must come apart the same whole and streamed, with no marker
in what the client is shown."""

import json
from pathlib import Path

import jsonschema
import ollama
import openai
import pytest

from tests.http_server import openai_client
from tests.test_gpt_oss import GPT_OSS
from tests.test_harmony import MARKERS
from tests.test_reasoning import ASK, SCHEMA, load, thinking_checkpoint
from tinyllm import LLM, SamplingParams
from tinyllm.entrypoints.server.responses_input import chat_body
from tinyllm.entrypoints.server.responses_protocol import ResponsesRequest
from tinyllm.text.reasoning import HARMONY
from tinyllm.text.tool_formats import HARMONY as HARMONY_CALLS

pytestmark = pytest.mark.slow

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"The {name} of a country.",
            "parameters": {
                "type": "object",
                "properties": {"country": {"enum": ["France", "Italy"]}},
                "required": ["country"],
            },
        },
    }
    for name in ("capital", "population")
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("harmony") / "gpt-oss"
    shape = {**GPT_OSS, "tie_word_embeddings": False}
    return thinking_checkpoint(path, "openai-gpt-oss-120b.jinja", tuple(MARKERS), "GptOss", **shape)


@pytest.fixture(scope="module")
def llm(checkpoint):
    return load(checkpoint)


@pytest.fixture(scope="module")
def client(llm):
    with openai_client(llm) as c:
        yield c


@pytest.fixture(scope="module")
def thinks(llm):
    """A greedy request for ASK with `fields`, steered into the analysis channel (thinking at
    most `budget` tokens)."""
    (analysis,) = llm.tokenizer.encode("analysis", add_special_tokens=False)

    def body(client, budget: int, **fields) -> dict:
        extra = {"thinking_token_budget": budget} if budget else {}
        return dict(
            model=client.model,
            messages=ASK,
            temperature=0,
            logit_bias={str(analysis): 30.0},
            extra_body=extra,
            **fields,
        )

    return body


def shown(*texts: str | None) -> None:
    for text in texts:
        assert "<|" not in (text or ""), text


def streamed(client, **body) -> tuple[str, str, list[tuple[str, str]], str]:
    """(reasoning, content, calls as (name, arguments), finish reason) from the stream."""
    reasoning, content, calls, reason = "", "", {}, None
    for chunk in client.chat.completions.create(**body, stream=True):
        choice = chunk.choices[0]
        delta = choice.delta
        reasoning += delta.model_extra.get("reasoning_content") or ""
        content += delta.content or ""
        for c in delta.tool_calls or []:
            if c.function.name:
                calls[c.index] = [c.function.name, ""]
            calls[c.index][1] += c.function.arguments or ""
        reason = choice.finish_reason or reason
    return reasoning, content, [tuple(c) for c in calls.values()], reason


def test_a_required_call_after_thinking(client, thinks) -> None:
    body = thinks(client, 4, max_tokens=60, tools=TOOLS, tool_choice="required", logprobs=True)
    whole = client.chat.completions.create(**body)
    message, choice = whole.choices[0].message, whole.choices[0]
    tokens = [t.token for t in choice.logprobs.content]
    assert tokens[:3] == ["<|channel|>", "analysis", "<|message|>"] and tokens[7] == "<|end|>"
    assert tokens[-1] == "<|call|>"
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning == "analysis" * 4 and message.model_extra["reasoning"] == reasoning
    assert not message.content
    (call,) = message.tool_calls
    assert call.function.name in ("capital", "population")
    assert json.loads(call.function.arguments)["country"] in ("France", "Italy")
    assert choice.finish_reason == "tool_calls"
    assert whole.usage.completion_tokens_details.reasoning_tokens == 8
    body.pop("logprobs")
    calls = [(call.function.name, call.function.arguments)]
    assert streamed(client, **body) == (reasoning, "", calls, "tool_calls")


def test_a_named_function_is_the_one_called(client, thinks) -> None:
    named = {"type": "function", "function": {"name": "population"}}
    out = client.chat.completions.create(
        **thinks(client, 2, max_tokens=40, tools=TOOLS, tool_choice=named)
    )
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "population"
    assert out.choices[0].message.model_extra["reasoning_content"] == "analysis" * 2


def test_a_final_answer_after_thinking_whole_and_streamed(client, thinks) -> None:
    body = thinks(client, 3, max_tokens=14)
    whole = client.chat.completions.create(**body)
    message = whole.choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    # 3 thought, then <|end|><|start|>assistant<|channel|>final<|message|>: 14 - 13 left.
    assert reasoning == "analysis" * 3 and message.content
    shown(reasoning, message.content)
    assert whole.choices[0].finish_reason == "length"
    assert streamed(client, **body) == (reasoning, message.content, [], "length")


def test_a_json_answer_after_thinking_and_without(client, thinks) -> None:
    schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    thought = client.chat.completions.create(
        **thinks(client, 2, max_tokens=60, response_format=schema)
    )
    message = thought.choices[0].message
    assert message.model_extra["reasoning_content"] == "analysis" * 2
    jsonschema.validate(json.loads(message.content), SCHEMA)
    assert thought.choices[0].finish_reason == "stop"  # at <|return|>, the grammar's end
    # Thinking off: an empty analysis message in the prompt, and none allowed after it.
    body = thinks(client, 0, max_tokens=60, response_format=schema)
    off = client.chat.completions.create(**{**body, "extra_body": {"enable_thinking": False}})
    message = off.choices[0].message
    assert message.model_extra.get("reasoning_content") is None
    jsonschema.validate(json.loads(message.content), SCHEMA)
    assert off.usage.completion_tokens_details.reasoning_tokens == 0


def test_return_and_call_end_the_answer(client, llm) -> None:
    for marker in ("<|return|>", "<|call|>"):
        out = client.chat.completions.create(
            model=client.model,
            messages=ASK,
            max_tokens=5,
            temperature=0,
            logit_bias={str(llm.tokenizer.token_to_id(marker)): 100.0},
        )
        assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == 1
        assert not out.choices[0].message.content


def test_reasoning_effort_reaches_the_template(client) -> None:
    """The first token's logprobs: the prompt differs where the template writes the effort."""

    def first_token(**extra) -> dict[str, float]:
        out = client.chat.completions.create(
            model=client.model,
            messages=ASK,
            max_tokens=1,
            temperature=0,
            logprobs=True,
            top_logprobs=5,
            **extra,
        )
        return {t.token: t.logprob for t in out.choices[0].logprobs.content[0].top_logprobs}

    def same(a: dict[str, float], b: dict[str, float]) -> bool:
        # Within float rounding: a prompt the prefix cache holds in part is prefilled in
        # other steps.
        return a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)

    high = first_token(reasoning_effort="high")
    low, medium = first_token(reasoning_effort="low"), first_token()  # medium: the default
    assert not same(high, low) and not same(low, medium) and not same(high, medium)
    kwargs = {"chat_template_kwargs": {"reasoning_effort": "high"}}
    assert same(high, first_token(extra_body=kwargs))
    with pytest.raises(openai.BadRequestError, match="reasoning_effort") as e:
        first_token(reasoning_effort="extreme")
    assert e.value.body["param"] == "reasoning_effort"
    # Responses' reasoning.effort is the same field.
    request = ResponsesRequest(input="Hi", reasoning={"effort": "high"})
    assert chat_body(request, [], [])["reasoning_effort"] == "high"


def test_llm_chat_responses_and_ollama_give_the_chat_dialects_answer(checkpoint) -> None:
    """Greedy, unbiased, thinking 3 tokens at most (`--reasoning-budget`, as Responses and
    Ollama have no budget of their own): the same reasoning and call from LLM.chat, the chat
    dialect, Responses whole and streamed, and Ollama's chat."""
    llm = load(checkpoint)
    llm.reasoning_budget = 3
    params = SamplingParams(max_tokens=60, temperature=0)
    (offline,) = llm.chat(ASK, params, use_tqdm=False, tools=TOOLS, tool_choice="required")
    with openai_client(llm) as client:
        chat = client.chat.completions.create(
            model=client.model,
            messages=ASK,
            max_tokens=60,
            temperature=0,
            tools=TOOLS,
            tool_choice="required",
        ).choices[0]
        body = dict(
            model=client.model,
            input=ASK[0]["content"],
            max_output_tokens=60,
            temperature=0,
            tools=[{"type": "function", **t["function"]} for t in TOOLS],
            tool_choice="required",
        )
        out = client.responses.create(**body)
        with client.responses.stream(**body) as stream:
            final = stream.get_final_response()
        # Ollama's think level (what it takes for gpt-oss) is the effort; its tools are "auto".
        auto = (
            client.chat.completions.create(
                model=client.model,
                messages=ASK,
                max_tokens=30,
                temperature=0,
                tools=TOOLS,
                reasoning_effort="high",
            )
            .choices[0]
            .message
        )
        host = str(client.base_url).removesuffix("/v1/")
        options = {"temperature": 0, "num_predict": 30}
        local = (
            ollama.Client(host=host)
            .chat(model=client.model, messages=ASK, tools=TOOLS, think="high", options=options)
            .message
        )
    (call,) = chat.message.tool_calls
    reasoning = chat.message.model_extra.get("reasoning_content")
    assert reasoning  # greedy, this model thinks first
    completion = offline.outputs[0]
    assert (completion.reasoning, completion.text) == (reasoning, "")
    assert [(c.name, c.arguments, c.complete) for c in completion.tool_calls] == [
        (call.function.name, call.function.arguments, True)
    ]
    assert [item.type for item in out.output] == ["reasoning", "function_call"]
    thought, fc = out.output
    assert thought.content[0].text == reasoning
    assert (fc.name, fc.arguments) == (call.function.name, call.function.arguments)
    assert local.thinking == auto.model_extra["reasoning_content"] and local.thinking
    assert (local.content or "") == (auto.content or "")
    assert [(c.function.name, c.function.arguments) for c in local.tool_calls or []] == [
        (c.function.name, json.loads(c.function.arguments)) for c in auto.tool_calls or []
    ]
    same = {"id", "call_id", "parsed_arguments"}  # set apart by the SDK's stream helper
    assert [i.model_dump(exclude=same) for i in final.output] == [
        i.model_dump(exclude=same) for i in out.output
    ]


def test_the_openai_tool_parser_brings_harmonys_channels(checkpoint) -> None:
    """Harmony's calls are parsed with its channels: naming its tool-call parser is enough."""
    llm = LLM(
        str(checkpoint),
        "float32",
        quantization="none",
        max_model_len=512,
        num_blocks=64,
        reasoning_parser="none",
        tool_call_parser="openai",
    )
    assert llm.reasoning is HARMONY and llm.tool_format is HARMONY_CALLS
