"""Request bodies that client libraries send beyond OpenAI's current reference, against the real
server on the default model: `models.retrieve`, a schema beside `response_format`'s type, the
legacy `functions` API, and unknown fields inside nested objects (listed for the log)."""

import json

import jsonschema
import openai
import pytest

from tests.http_server import openai_client
from tinyllm.entrypoints.server.engine_requests import chat_prompt
from tinyllm.entrypoints.server.protocol import ChatCompletionRequest

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def client(default_llm):
    with openai_client(default_llm) as c:
        yield c


def chat(client, prompt: str, **kw):
    kw = {"temperature": 0, "max_tokens": 40, **kw}
    return client.chat.completions.create(
        model=client.model, messages=[{"role": "user", "content": prompt}], **kw
    )


def test_models_retrieve_gives_the_card_and_a_404_naming_another_id(client):
    card = client.models.retrieve(client.model)
    assert card.id == client.model and card.object == "model"
    assert card.id in [m.id for m in client.models.list().data]
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("someone/other-model")
    error = e.value.body
    assert "someone/other-model" in error["message"] and error["code"] == "model_not_found"


@pytest.mark.parametrize(
    "fmt",
    [
        {"type": "json_object", "schema": PERSON},  # Together-, Fireworks-style
        {"type": "json_schema", "json_schema": {"schema": PERSON}},  # no name: llama.cpp's docs
        {"type": "json_schema", "schema": PERSON},
    ],
    ids=["json_object+schema", "json_schema-no-name", "json_schema+schema"],
)
def test_response_format_schema_variants_are_honoured(client, fmt):
    choice = chat(client, "Describe a person.", response_format=fmt).choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_response_format_with_two_schemas_is_a_400(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": PERSON}, "schema": PERSON}
    with pytest.raises(openai.BadRequestError, match="json_schema.schema or schema"):
        chat(client, "Describe a person.", response_format=fmt)


def test_bad_schema_beside_the_type_is_a_400_naming_it(client):
    fmt = {"type": "json_object", "schema": {"type": "object", "properties": {"a": {"type": 5}}}}
    with pytest.raises(openai.BadRequestError, match=r"response_format\.schema"):
        chat(client, "Hi", response_format=fmt)


def test_ignored_fields_lists_unknown_fields_inside_nested_objects():
    req = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                # an earlier answer sent back as the openai SDK dumps it: nothing unknown
                {"role": "assistant", "content": "Hi", "refusal": None, "annotations": []},
                {"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": {}}]},
            ],
            "tools": [{"type": "function", "function": {**WEATHER, "examples": []}}],
            "response_format": {"type": "json_schema", "json_schema": {"schema": {}, "x": 1}},
            "stream_options": {"include_usage": True, "continuous": True},
            "store": False,
        }
    )
    assert sorted(req.ignored_fields()) == [
        "messages.2.content.0.cache_control",
        "response_format.json_schema.x",
        "store",
        "stream_options.continuous",
        "tools.0.function.examples",
    ]
    legacy = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "Hi"}], "functions": [{**WEATHER, "y": 1}]}
    )
    assert legacy.ignored_fields() == ["functions.0.y"]  # once, though its tools share it


LEGACY_CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "function_call": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    },  # noqa: E501
    {"role": "function", "name": "get_weather", "content": "sunny"},
]


def test_legacy_functions_render_as_the_tools_they_stand_for(default_llm):
    legacy = ChatCompletionRequest.model_validate(
        {"messages": LEGACY_CONVERSATION, "functions": [WEATHER], "function_call": "auto"}
    )
    modern = ChatCompletionRequest.model_validate(
        {
            "messages": [
                LEGACY_CONVERSATION[0],
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": LEGACY_CONVERSATION[1]["function_call"],
                        }  # noqa: E501
                    ],
                },
                {
                    "role": "tool",
                    "tool_call_id": "call_1",
                    "name": "get_weather",
                    "content": "sunny",
                },  # noqa: E501
            ],
            "tools": [{"type": "function", "function": WEATHER}],
            "tool_choice": "auto",
        }
    )
    assert legacy.legacy_functions and not modern.legacy_functions
    assert legacy.tool_choice == "auto" and legacy.parallel_tool_calls is False
    tools = [t.model_dump(exclude_none=True) for t in legacy.tools]
    rendered = chat_prompt(default_llm.tokenizer, legacy.messages, tools=tools)
    expected = chat_prompt(
        default_llm.tokenizer,
        modern.messages,
        tools=[t.model_dump(exclude_none=True) for t in modern.tools],
    )
    assert rendered.text == expected.text and "sunny" in rendered.text


def test_legacy_functions_and_tools_together_are_a_400(client):
    with pytest.raises(openai.BadRequestError, match="not both"):
        chat(
            client,
            "Hi",
            functions=[WEATHER],
            tools=[{"type": "function", "function": WEATHER}],
        )
    with pytest.raises(openai.BadRequestError, match="function_call names 'f', but no functions"):
        chat(client, "Hi", function_call={"name": "f"})
    # "auto" with no functions is a plain chat
    assert chat(client, "Hi", function_call="auto", max_tokens=3).choices[0].message.content


def test_legacy_function_call_answers_with_function_call(client):
    """A named function_call is a forced call; OpenAI answers it in message.function_call."""
    answer = chat(
        client,
        "What is the weather in Paris?",
        functions=[WEATHER],
        function_call={"name": "get_weather"},
    ).choices[0]
    assert answer.finish_reason == "function_call"
    call = answer.message.function_call
    assert call is not None and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    assert not answer.message.tool_calls
