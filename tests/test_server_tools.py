"""Tool calling through the official openai client against the real server on the default model
(whose template has no tool support: tinyllm's generic format). With `required` or a named
function the answer is always a call whose arguments validate; streamed calls reassemble to the
non-streamed answer; `none` never calls; a tool result goes back for a second turn."""

import json
import re
from pathlib import Path

import httpx
import jsonschema
import openai
import pydantic
import pytest

from tests.http_server import openai_client

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two numbers",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                "b": {"type": "integer", "minimum": -1000, "maximum": 1000},
            },
            "required": ["a", "b"],
        },
    },
}
TOOLS = [WEATHER, ADD]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
PROMPTS = [
    "What is the weather like in Paris today?",
    "What is 12 plus 30?",
    "Tell me a joke about cats.",
]
CHOICES = ["required", *({"type": "function", "function": {"name": n}} for n in PARAMETERS)]
MAX_TOKENS = 96
README = Path(__file__).resolve().parent.parent / "README.md"


@pytest.fixture(scope="module")
def client(default_llm):
    with openai_client(default_llm) as c:
        yield c


def ask(client, prompt: str | list[dict], tool_choice, **kw):
    """Greedy; one call at most unless parallel_tool_calls says otherwise (the default)."""
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    kw = {"temperature": 0, "max_tokens": MAX_TOKENS, **kw}
    return client.chat.completions.create(
        model=client.model, messages=messages, tools=TOOLS, tool_choice=tool_choice, **kw
    )


def assert_valid_calls(calls, allowed: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


@pytest.mark.parametrize("tool_choice", CHOICES, ids=["required", *PARAMETERS])
def test_required_and_named_functions_always_call_with_valid_arguments(client, tool_choice):
    allowed = set(PARAMETERS) if tool_choice == "required" else {tool_choice["function"]["name"]}
    for prompt in PROMPTS:
        choice = ask(client, prompt, tool_choice).choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None
        assert_valid_calls(choice.message.tool_calls, allowed)


def _streamed(client, prompt: str, tool_choice, **kw) -> tuple[str, list[dict], str]:
    """Content, calls and finish reason reassembled from the raw chunks, as OpenAI documents;
    each call's "pieces" counts the deltas its arguments came in."""
    content, calls, reason = "", [], None
    for chunk in ask(client, prompt, tool_choice, stream=True, **kw):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or []:
            if d.id is not None:  # the first delta of a call: id, type and name
                assert d.index == len(calls) and d.type == "function" and d.function.name
                calls.append({"id": d.id, "name": d.function.name, "arguments": "", "pieces": 0})
            calls[d.index]["arguments"] += d.function.arguments or ""
            calls[d.index]["pieces"] += d.id is None
        reason = chunk.choices[0].finish_reason or reason
    return content, calls, reason


@pytest.mark.parametrize(
    ("prompt", "tool_choice"), [(PROMPTS[0], CHOICES[0]), (PROMPTS[1], CHOICES[2])]
)
def test_streamed_calls_reassemble_to_the_non_streamed_answer(client, prompt, tool_choice):
    whole = ask(client, prompt, tool_choice).choices[0]
    content, calls, reason = _streamed(client, prompt, tool_choice)
    assert (content, reason) == ("", "tool_calls")
    expected = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert [(c["name"], c["arguments"]) for c in calls] == expected
    assert all(c["id"].startswith("call_") for c in calls)
    # The arguments came in pieces as they were generated, not in one delta at the end.
    assert all(c["pieces"] > 1 for c in calls)


def test_parallel_calls_are_each_well_formed(client):
    choice = ask(client, PROMPTS[0], "required", parallel_tool_calls=True).choices[0]
    complete = choice.message.tool_calls
    if choice.finish_reason == "length":  # the last call was cut: its arguments are partial
        complete = complete[:-1]
    else:
        assert choice.finish_reason == "tool_calls"
    assert_valid_calls(complete, set(PARAMETERS))


def test_the_clients_stream_helper_assembles_the_call(client):
    kw = dict(tools=TOOLS, tool_choice="required", temperature=0, max_tokens=MAX_TOKENS)
    messages = [{"role": "user", "content": PROMPTS[0]}]
    whole = client.chat.completions.create(model=client.model, messages=messages, **kw)
    with client.chat.completions.stream(model=client.model, messages=messages, **kw) as stream:
        final = stream.get_final_completion()
    got, expected = final.choices[0].message.tool_calls, whole.choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in got] == [
        (c.function.name, c.function.arguments) for c in expected
    ]


def test_none_never_calls(client):
    for prompt, stream in zip(PROMPTS, (False, True, False), strict=True):
        if stream:
            content, calls, reason = _streamed(client, prompt, "none")
        else:
            choice = ask(client, prompt, "none").choices[0]
            message = choice.message
            content, calls, reason = message.content, message.tool_calls or [], choice.finish_reason
        assert calls == [] and reason in ("stop", "length")
        assert content and "<tool_call>" not in content


def test_auto_answers_in_text_or_with_a_well_formed_call(client):
    for prompt in PROMPTS:
        choice = ask(client, prompt, "auto").choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            assert_valid_calls(choice.message.tool_calls, set(PARAMETERS))
        else:
            assert choice.message.content and "<tool_call>" not in choice.message.content


def test_a_tool_result_goes_back_for_the_next_turn(client):
    messages = [{"role": "user", "content": PROMPTS[0]}]
    first = ask(client, messages, {"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18}'},
    ]
    second = ask(client, messages, "none")
    choice = second.choices[0]
    assert choice.message.content and not choice.message.tool_calls
    # The call and its result are in the second prompt.
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens


def test_bad_tool_requests_are_400s_naming_the_field(client):
    cases = [
        (
            dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
            "tool_choice",
            "no function 'nope'",
        ),
        (dict(tool_choice="required"), "tool_choice", "tool_choice needs tools"),
        (
            dict(
                tools=[
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {
                                "type": "object",
                                "properties": {"x": {"type": "strin"}},
                            },
                        },
                    }
                ]
            ),
            "tools",
            r"tools.0.function.parameters \(f\)",
        ),
        (dict(tools=[ADD, ADD]), "tools", "given twice"),
        (
            dict(tools=TOOLS, extra_body={"structured_outputs": {"regex": "a+"}}),
            "tool_choice",
            "structured_outputs.regex with tools: only a JSON schema",
        ),
    ]
    for kw, param, message in cases:
        with pytest.raises(openai.BadRequestError, match=message) as e:
            client.chat.completions.create(
                model=client.model, messages=[{"role": "user", "content": "hi"}], max_tokens=4, **kw
            )
        assert e.value.body["param"] == param
    # And the server goes on.
    assert ask(client, PROMPTS[1], "required").choices[0].finish_reason == "tool_calls"


def test_readmes_tool_call_example_prints_what_it_says(client, capsys):
    section = README.read_text().split("Tool calls work the same way", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    shown = re.search(r"print\(.*\)  # (.*)", code).group(1)
    code = code.replace('OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="secret")', "CLIENT")
    exec(compile(code, str(README), "exec"), {"CLIENT": client})
    assert capsys.readouterr().out == shown + "\n"


def test_tokenize_renders_the_tools_as_chat_completions_do(client):
    url = str(client.base_url).removesuffix("v1/") + "tokenize"
    body = {"messages": [{"role": "user", "content": PROMPTS[0]}]}
    plain = httpx.post(url, json=body).json()
    with_tools = httpx.post(url, json={**body, "tools": TOOLS}).json()
    answer = ask(client, PROMPTS[0], "none", max_tokens=1)
    assert with_tools["count"] == answer.usage.prompt_tokens > plain["count"] + 50


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=24)
    country: str = pydantic.Field(max_length=24)


class Forecast(pydantic.BaseModel):
    """Nested models: Pydantic writes them as $defs with $refs."""

    city: City
    days: int = pydantic.Field(ge=1, le=7)


def test_tool_parameters_with_defs_and_refs_as_pydantic_writes_them(client):
    tool = openai.pydantic_function_tool(Forecast)
    assert "$defs" in tool["function"]["parameters"]  # what the client library sends
    for stream in (False, True):
        kw = dict(tools=[tool], tool_choice="required", temperature=0, max_tokens=MAX_TOKENS)
        messages = [{"role": "user", "content": PROMPTS[0]}]
        if stream:
            with client.chat.completions.stream(model=client.model, messages=messages, **kw) as s:
                choice = s.get_final_completion().choices[0]
        else:
            choice = client.chat.completions.create(model=client.model, messages=messages, **kw)
            choice = choice.choices[0]
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        Forecast.model_validate_json(call.function.arguments)


class Answer(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=24)
    celsius: int = pydantic.Field(ge=-50, le=50)


def test_response_format_beside_tools_is_calls_or_that_json(client):
    # What the Agents SDK sends for Agent(output_type=..., tools=[...]).
    tool = openai.pydantic_function_tool(Forecast)
    for prompt in PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        kw = dict(tools=[tool], temperature=0, max_tokens=MAX_TOKENS, response_format=Answer)
        choice = client.chat.completions.parse(model=client.model, messages=messages, **kw)
        choice = choice.choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            Forecast.model_validate_json(choice.message.tool_calls[0].function.arguments)
        else:
            assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Answer)
        forced = client.chat.completions.parse(
            model=client.model, messages=messages, tool_choice="required", **kw
        ).choices[0]
        assert forced.finish_reason == "tool_calls" and forced.message.tool_calls


@pytest.mark.parametrize("max_tokens", [3, 8, 14])
def test_a_call_cut_by_max_tokens_leaves_no_markup_in_the_content(client, max_tokens):
    whole = ask(client, PROMPTS[0], "required", max_tokens=max_tokens).choices[0]
    content, calls, reason = _streamed(client, PROMPTS[0], "required", max_tokens=max_tokens)
    assert whole.finish_reason == reason == "length"
    assert not whole.message.content and content == ""
    expected = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    assert [(c["name"], c["arguments"]) for c in calls] == expected


def test_a_stop_string_inside_a_forced_call_is_not_a_finished_call(client):
    whole = ask(client, PROMPTS[0], "required", stop=["}"]).choices[0]
    content, calls, reason = _streamed(client, PROMPTS[0], "required", stop=["}"])
    # The call did not complete: OpenAI's "length", never "tool_calls".
    assert whole.finish_reason == reason == "length"
    assert not whole.message.content and content == ""
    assert [c.function.name for c in whole.message.tool_calls] == [c["name"] for c in calls]
