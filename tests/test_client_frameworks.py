"""Agent frameworks and client libraries, unchanged, against the real server on the default model:
instructor, pydantic-ai, LangChain's ChatOpenAI and litellm, each sending the bodies it sends
its users' models. The model is tiny and greedy, so the tests assert what the server guarantees
(answers follow the schema, calls name a given tool with arguments that validate, the framework
parses them into its Pydantic models), not what a capable model would answer. A library that
does not import is skipped with the reason."""

import json
import os

import jsonschema
import openai
import pydantic
import pytest

from tests.http_server import serving
from tinyllm.entrypoints.server.app import create_app

pytestmark = pytest.mark.slow

MAX_TOKENS = 80


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)


class Address(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=20)
    country: str = pydantic.Field(max_length=20)


class Person(pydantic.BaseModel):
    """Nested: Pydantic writes Address under $defs and refers to it."""

    name: str = pydantic.Field(max_length=20)
    age: int = pydantic.Field(ge=0, le=130)
    address: Address


def get_population(city: str) -> int:
    """The population of a city."""
    assert isinstance(city, str)  # the framework validated the arguments before calling
    return 1000


WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}


def need(module: str):
    return pytest.importorskip(module, reason=f"{module} does not import here")


@pytest.fixture(scope="module")
def server(default_llm):
    """The server's base URL and the model's name: one server for the module."""
    with serving(create_app(default_llm)) as url:
        yield f"{url}/v1", default_llm.model_name


# -- instructor ---------------------------------------------------------------------------------


def instructor_client(server, mode_name: str):
    instructor = need("instructor")
    url, _ = server
    raw = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
    return instructor.from_openai(raw, mode=getattr(instructor.Mode, mode_name))


def instructor_create(server, mode: str, response_model, prompt: str):
    client = instructor_client(server, mode)
    return client.chat.completions.create(
        model=server[1],
        response_model=response_model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        max_retries=1,  # one attempt: a retry would hide an answer that did not validate
    )


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_fills_a_nested_model(server, mode):
    person = instructor_create(server, mode, Person, "Describe a person and their address.")
    assert isinstance(person, Person) and isinstance(person.address, Address)


def test_instructor_iterable_of_models(server):
    from collections.abc import Iterable

    cities = instructor_create(server, "TOOLS", Iterable[City], "Name two cities.")
    cities = list(cities)
    assert all(isinstance(c, City) for c in cities)


# -- pydantic-ai --------------------------------------------------------------------------------


def pydantic_ai_agent(server, **kw):
    need("pydantic_ai")
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    url, name = server
    model = OpenAIChatModel(name, provider=OpenAIProvider(base_url=url, api_key="unused"))
    settings = {"max_tokens": MAX_TOKENS, "temperature": 0}
    return Agent(model, model_settings=settings, **kw)


def test_pydantic_ai_nested_output_type(server):
    agent = pydantic_ai_agent(server, output_type=Person, retries=0)
    result = agent.run_sync("Describe a person and their address.")
    assert isinstance(result.output, Person) and isinstance(result.output.address, Address)


def test_pydantic_ai_native_output(server):
    from pydantic_ai import NativeOutput

    agent = pydantic_ai_agent(server, output_type=NativeOutput(Person), retries=0)
    result = agent.run_sync("Describe a person and their address.")
    assert isinstance(result.output, Person)


def tool_run_messages(agent, prompt: str, **kw) -> list:
    """The messages of a run cut after its first model request: a tiny model may call tools
    without end, so the run stops at the usage limit once the first calls have run."""
    from pydantic_ai import UsageLimitExceeded, UsageLimits, capture_run_messages

    with capture_run_messages() as messages:
        try:
            agent.run_sync(prompt, usage_limits=UsageLimits(request_limit=1), **kw)
        except UsageLimitExceeded:
            pass
    return messages


def test_pydantic_ai_calls_a_tool(server):
    """A function tool beside a tool output: each answer must call one of them (required)."""
    from pydantic_ai import RetryPromptPart, ToolCallPart, ToolReturnPart

    agent = pydantic_ai_agent(server, output_type=City, tools=[get_population], retries=0)
    messages = tool_run_messages(agent, "How many people live in Paris? Call get_population.")
    parts = [p for m in messages for p in m.parts]
    calls = [p for p in parts if isinstance(p, ToolCallPart)]
    assert calls and all(c.tool_name in ("get_population", "final_result") for c in calls)
    assert not [p for p in parts if isinstance(p, RetryPromptPart)]  # arguments validated
    returns = [p for p in parts if isinstance(p, ToolReturnPart)]
    ran = [r.content for r in returns if r.tool_name == "get_population"]
    assert ran == [1000] * sum(c.tool_name == "get_population" for c in calls)


def test_pydantic_ai_native_output_with_a_tool(server):
    """response_format and tools together (what NativeOutput with a tool sends): the answer is
    calls to the tool, or JSON following the schema."""
    from pydantic_ai import NativeOutput, RetryPromptPart, ToolCallPart

    agent = pydantic_ai_agent(
        server, output_type=NativeOutput(City), tools=[get_population], retries=0
    )
    messages = tool_run_messages(agent, "Which city has the most people?")
    response = messages[1]
    calls = [p for p in response.parts if isinstance(p, ToolCallPart)]
    assert all(c.tool_name == "get_population" for c in calls)
    assert not [p for m in messages for p in m.parts if isinstance(p, RetryPromptPart)]
    if not calls:
        City.model_validate_json(response.parts[0].content)


# -- LangChain ----------------------------------------------------------------------------------


def chat_openai(server):
    need("langchain_openai")
    from langchain_openai import ChatOpenAI

    url, name = server
    return ChatOpenAI(
        model=name,
        base_url=url,
        api_key="unused",
        temperature=0,
        max_tokens=MAX_TOKENS,
        max_retries=0,
    )


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(server, method):
    llm = chat_openai(server).with_structured_output(Person, method=method)
    person = llm.invoke("Describe a person and their address.")
    assert isinstance(person, Person) and isinstance(person.address, Address)


def test_langchain_bind_tools(server):
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": WEATHER_PARAMETERS,
        },
    }
    for choice in ["get_weather", "any"]:  # named, and "any" (OpenAI's required)
        llm = chat_openai(server).bind_tools([weather, get_population], tool_choice=choice)
        message = llm.invoke("What is the weather in Paris?")
        assert message.tool_calls, message
        for call in message.tool_calls:
            if call["name"] == "get_weather":
                jsonschema.validate(call["args"], WEATHER_PARAMETERS)
            else:
                assert choice == "any" and call["name"] == "get_population"
                assert isinstance(call["args"]["city"], str)


# -- litellm ------------------------------------------------------------------------------------


@pytest.fixture
def litellm():
    # The model price list ships with litellm: no fetch from the network at import.
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    return need("litellm")


def litellm_completion(litellm, server, **kw):
    url, name = server
    return litellm.completion(
        model=f"openai/{name}",
        api_base=url,
        api_key="unused",
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        **kw,
    )


def test_litellm_completion(litellm, server):
    response = litellm_completion(litellm, server)
    choice = response.choices[0]
    assert isinstance(choice.message.content, str) and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert response.usage.completion_tokens > 0


def test_litellm_completion_tools_and_schema(litellm, server):
    tool = {
        "type": "function",
        "function": {"name": "get_weather", "parameters": WEATHER_PARAMETERS},
    }
    response = litellm_completion(litellm, server, tools=[tool], tool_choice="required")
    calls = response.choices[0].message.tool_calls
    assert calls and all(c.function.name == "get_weather" for c in calls)
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments), WEATHER_PARAMETERS)
    response = litellm_completion(litellm, server, response_format=Person)
    Person.model_validate_json(response.choices[0].message.content)


def test_litellm_responses(litellm, server, caplog):
    """litellm.responses against /v1/responses (its OpenAI provider sends the Responses body,
    as the server's log of `resp_` requests shows): the text, and a forced call whose arguments
    validate."""
    caplog.set_level("INFO", logger="tinyllm.server")
    url, name = server
    common = dict(model=f"openai/{name}", api_base=url, api_key="unused", temperature=0)
    response = litellm.responses(input="Say hello.", max_output_tokens=MAX_TOKENS, **common)
    texts = [p.text for item in response.output if item.type == "message" for p in item.content]
    assert "".join(texts) and response.usage.output_tokens > 0
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER_PARAMETERS}
    response = litellm.responses(
        input="What is the weather in Paris?",
        tools=[tool],
        tool_choice="required",
        max_output_tokens=MAX_TOKENS,
        **common,
    )
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and all(c.name == "get_weather" for c in calls)
    for c in calls:
        jsonschema.validate(json.loads(c.arguments), WEATHER_PARAMETERS)
    started = [r.getMessage() for r in caplog.records if ": started," in r.getMessage()]
    assert len(started) == 2 and all(m.startswith("resp_") for m in started)
