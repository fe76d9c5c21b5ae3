"""response_format and vLLM's structured_outputs through the official openai client against the
real server on the default model: outputs parse and validate; `.parse` fills a Pydantic model;
a schema that does not compile is a 400 naming it while other requests go on."""

import json
import re

import jsonschema
import openai
import pydantic
import pytest

from tests.http_server import openai_client

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "hobbies": {"type": "array", "items": {"enum": ["chess", "music", "sport"]}, "maxItems": 3},
    },
    "required": ["name", "age", "hobbies"],
    "additionalProperties": False,
}
CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,15}$"},
        "country": {"anyOf": [{"type": "string", "maxLength": 20}, {"type": "null"}]},
    },
    "required": ["city"],
}
MAX_TOKENS = 80


class Capital(pydantic.BaseModel):
    country: str = pydantic.Field(max_length=30)
    capital: str = pydantic.Field(max_length=30)


@pytest.fixture(scope="module")
def client(default_llm):
    with openai_client(default_llm) as c:
        yield c


def chat(client, prompt: str, **kw):
    kw = {"temperature": 0, "max_tokens": MAX_TOKENS, **kw}
    return client.chat.completions.create(
        model=client.model, messages=[{"role": "user", "content": prompt}], **kw
    )


@pytest.mark.parametrize("schema", [PERSON, CITY], ids=["person", "city"])
def test_json_schema_answers_parse_and_validate(client, schema):
    for prompt, temperature in [("Describe a person.", 0), ("Name a city in Europe.", 0.8)]:
        fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
        choice = chat(client, prompt, response_format=fmt, temperature=temperature, seed=1)
        choice = choice.choices[0]
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_answers_are_objects(client):
    answer = chat(client, "List three colours.", response_format={"type": "json_object"})
    assert isinstance(json.loads(answer.choices[0].message.content), dict)


def test_the_clients_parse_fills_a_pydantic_model(client):
    completion = client.chat.completions.parse(
        model=client.model,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        response_format=Capital,
        temperature=0,
        max_tokens=MAX_TOKENS,
    )
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Capital) and parsed.capital


def test_structured_outputs_regex_and_choice_on_completions(client):
    date = r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"
    for extra, check in [
        ({"regex": date}, lambda t: re.fullmatch(date, t)),
        ({"choice": ["positive", "negative"]}, lambda t: t in ("positive", "negative")),
    ]:
        out = client.completions.create(
            model=client.model,
            prompt="The date of the moon landing, and my mood:",
            max_tokens=20,
            temperature=0,
            extra_body={"structured_outputs": extra},
        )
        assert check(out.choices[0].text), out.choices[0].text
        assert out.choices[0].finish_reason == "stop"


def test_a_bad_schema_is_a_400_naming_it_while_another_request_goes_on(client):
    other = chat(client, "Write a long story.", max_tokens=48, stream=True)
    text = next(iter(other)).choices[0].delta.content  # it is running
    bad = [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "object", "properties": {"a": {"type": "strin"}}},
                    },
                }
            },
            "response_format",
            r"response_format\.json_schema\.schema: .*strin",
        ),
        (
            {"extra_body": {"structured_outputs": {"regex": "(unclosed"}}},
            "structured_outputs",
            r"structured_outputs\.regex: ",
        ),
        (
            {"extra_body": {"structured_outputs": {"regex": "a", "choice": ["b"]}}},
            "structured_outputs",
            "exactly one",
        ),
    ]
    for kw, param, message in bad:
        with pytest.raises(openai.BadRequestError, match=message) as e:
            chat(client, "hi", **kw)
        assert e.value.body["param"] == param
    chunks = list(other)
    text += "".join(c.choices[0].delta.content or "" for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length" and text


def test_a_requests_grammar_compiles_once(client, compiles):
    # The server checks a request's constraint (which compiles it) before the engine adds it,
    # once per prompt: that compiled it twice per prompt, 1-5 ms each.
    # Constraints no other test sends: none is compiled yet.
    key = "compiles"
    schema = {"type": "object", "properties": {key: {"type": "integer"}}, "required": [key]}
    fmt = {"type": "json_schema", "json_schema": {"name": "once", "schema": schema}}
    for expected in (1, 1):  # the same schema again: compiled already
        answer = chat(client, "Count to three.", response_format=fmt, max_tokens=16)
        assert answer.choices[0].message.content.startswith(f'{{"{key}":')
        assert compiles.count == expected
    pattern = "[0-9]{2}-once"
    out = client.completions.create(
        model=client.model,
        prompt=["A number:", "Another number:"],
        n=2,
        max_tokens=8,
        extra_body={"structured_outputs": {"regex": pattern}},
    )
    assert len(out.choices) == 4 and all(re.fullmatch(pattern, c.text) for c in out.choices)
    assert compiles.count == 2
