"""StructuredOutputsParams: exactly one constraint, of the right type, named when wrong."""

import pytest

import tinyllm
from tinyllm.engine.sampling_params import SamplingParams
from tinyllm.engine.structured_output.params import StructuredOutputsParams


@pytest.mark.parametrize(
    "given",
    [
        {"json": {"type": "object"}},
        {"json": '{"type": "integer"}'},
        {"json_object": True},
        {"regex": r"\d+"},
        {"choice": ["yes", "no"]},
        {"grammar": 'start: "a"'},
    ],
)
def test_one_constraint_is_accepted(given: dict) -> None:
    params = StructuredOutputsParams(**given)
    assert SamplingParams(structured_outputs=params).structured_outputs is params


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({}, r"set exactly one of json, json_object, regex, choice, grammar; none were given"),
        ({"json": {}, "regex": "a"}, r"2 \(json, regex\) were given"),
        ({"json": 3}, r"StructuredOutputsParams\.json=3 must be dict or str, not an int"),
        ({"json_object": "yes"}, r"json_object='yes' must be bool, not a str"),
        ({"regex": b"a"}, r"regex=b'a' must be str, not a bytes"),
        ({"choice": "a,b"}, r"choice='a,b' must be list or tuple, not a str"),
        ({"choice": []}, r"choice=\[\] must be a non-empty list of non-empty strings"),
        ({"choice": ["a", 1]}, r"choice=\['a', 1\] must be a non-empty list"),
        ({"choice": ["a", ""]}, r"must be a non-empty list of non-empty strings"),
        ({"grammar": ""}, r"StructuredOutputsParams\.grammar is empty"),
    ],
)
def test_bad_params_name_the_field(given: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**given)


def test_sampling_params_checks_the_type() -> None:
    with pytest.raises(ValueError, match=r"structured_outputs=\{.*\} must be a StructuredOutputs"):
        SamplingParams(structured_outputs={"json": {}})


def test_exported_and_choice_copied() -> None:
    assert tinyllm.StructuredOutputsParams is StructuredOutputsParams
    choices = ("a", "b")
    assert StructuredOutputsParams(choice=choices).choice == ["a", "b"]


def test_objects_are_closed_unless_they_say_otherwise():
    """vLLM's default (xgrammar's strict mode) and OpenAI's strict mode: an object that declares
    its properties takes no others, at any depth, unless the schema opens it; `allOf` parts
    and objects without `properties` stay as they are, as do values (enum, const)."""
    from tinyllm.text.json_schema import closed_objects

    city = {"type": "object", "properties": {"name": {"type": "string"}}}
    schema = {
        "type": "object",
        "properties": {"city": city, "properties": {"type": "object", "properties": {}}},
        "$defs": {"c": city},
        "anyOf": [city, {"type": "object"}],
        "allOf": [city],
        "enum": [{"properties": {}}],
    }
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["city"]["additionalProperties"] is False
    assert closed["properties"]["properties"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]  # a map of names, not a schema
    assert closed["$defs"]["c"]["additionalProperties"] is False
    assert closed["anyOf"][0]["additionalProperties"] is False
    assert closed["anyOf"][1] == {"type": "object"}
    assert closed["allOf"] == [city] and closed["enum"] == schema["enum"]
    opened = {**city, "additionalProperties": {"type": "integer"}}
    assert closed_objects(opened) == opened
    assert "additionalProperties" not in city  # the caller's schema is not changed
