"""POST /v1/responses (OpenAI's Responses API) end to end: the default model behind a real uvicorn,
driven by the official openai SDK (create, the stream helper, parse) and the OpenAI Agents SDK's
default Responses model class. The tiny model's answers are not judged, only what the server
guarantees: shapes, validation, reassembly, the stored conversation and its prefix cache hit."""

import asyncio
import json
import typing

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from tests.http_server import serving
from tests.test_server import _FailingEngine, with_engine
from tinyllm import SamplingParams
from tinyllm.entrypoints.server.app import create_app
from tinyllm.entrypoints.server.chat_run import ChatDelta
from tinyllm.entrypoints.server.errors import APIError
from tinyllm.entrypoints.server.protocol import Usage
from tinyllm.entrypoints.server.responses_output import OutputBuilder
from tinyllm.entrypoints.server.responses_protocol import ResponseObject
from tinyllm.entrypoints.server.responses_store import ResponseStore, StoredResponse
from tinyllm.text.tool_calls import CallDelta

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"
INSTRUCTIONS = "Answer in one short sentence."
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}


class City(BaseModel):
    name: str = Field(max_length=20)
    capital: bool


@pytest.fixture(scope="module")
def llm(default_llm):
    return default_llm


@pytest.fixture(scope="module")
def offline(llm):
    """The greedy chat answer, run before the server's engine thread takes over the engine."""
    messages = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]
    params = SamplingParams(temperature=0, max_tokens=24)
    return llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text


@pytest.fixture(scope="module")
def base_url(llm, offline):
    with serving(create_app(llm)) as url:
        yield url


@pytest.fixture
def client(base_url, llm):
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0) as c:
        c.model = llm.model_name
        yield c


def ask(client, **kwargs):
    kwargs = {"model": client.model, "temperature": 0, **kwargs}
    return client.responses.create(**kwargs)


def assert_usage(r) -> None:
    u = r.usage
    assert u.input_tokens > 0 and u.output_tokens > 0
    assert u.total_tokens == u.input_tokens + u.output_tokens
    assert 0 <= u.input_tokens_details.cached_tokens <= u.input_tokens
    assert u.output_tokens_details.reasoning_tokens == 0  # the default model does not think


def test_create_is_the_chat_paths_greedy_answer(client, offline):
    r = ask(client, input=QUESTION, instructions=INSTRUCTIONS, max_output_tokens=24)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == offline and r.output_text
    message = r.output[-1]
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "output_text" and message.content[0].annotations == []
    assert r.status in ("completed", "incomplete")
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
        assert r.usage.output_tokens == 24
    assert_usage(r)
    # The request's settings come back as OpenAI echoes them.
    assert r.instructions == INSTRUCTIONS and r.max_output_tokens == 24 and r.temperature == 0
    assert r.tools == [] and r.tool_choice == "auto"


def test_instructions_and_developer_messages_are_one_system_message(client):
    split = ask(
        client,
        instructions="Be brief.",
        input=[{"role": "developer", "content": "Use French."}, {"role": "user", "content": "Hi"}],
        max_output_tokens=1,
        store=False,
    )
    joined = ask(
        client,
        input=[
            {"role": "system", "content": "Be brief.\n\nUse French."},
            {"role": "user", "content": "Hi"},
        ],
        max_output_tokens=1,
        store=False,
    )
    assert split.usage.input_tokens == joined.usage.input_tokens


def test_max_output_tokens_makes_it_incomplete(client):
    r = ask(client, input="Tell me a long story about the sea.", max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[-1].status == "incomplete"


def test_stream_helper_reassembles_the_greedy_answer(client):
    whole = ask(client, input=QUESTION, max_output_tokens=32)
    with client.responses.stream(
        model=client.model, input=QUESTION, temperature=0, max_output_tokens=32
    ) as stream:
        events = list(stream)
        final = stream.get_final_response() if whole.status == "completed" else None
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    end = "response.completed" if whole.status == "completed" else "response.incomplete"
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        end,
    ]
    item_id = events[2].item.id
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert deltas and all(e.item_id == item_id and e.output_index == 0 for e in deltas)
    text = "".join(e.delta for e in deltas)
    assert text == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens
    if final is not None:
        assert final.output_text == whole.output_text


def test_parse_with_a_pydantic_model(client):
    r = client.responses.parse(
        model=client.model,
        input="Name a city and say whether it is a capital, as JSON.",
        text_format=City,
        temperature=0,
        max_output_tokens=64,
    )
    assert isinstance(r.output_parsed, City)
    assert City.model_validate_json(r.output_text) == r.output_parsed
    assert r.text.format.type == "json_schema"


def test_json_object_format(client):
    r = ask(client, input="Describe Paris as JSON.", text={"format": {"type": "json_object"}})
    assert r.status == "completed"
    assert isinstance(json.loads(r.output_text), dict)


def call_of(r):
    calls = [i for i in r.output if i.type == "function_call"]
    assert len(calls) == 1, r.output
    return calls[0]


def test_function_tool_loop(client):
    first = ask(
        client, input="What is the weather in Paris?", tools=[WEATHER], tool_choice="required"
    )
    call = call_of(first)
    assert call.name == "get_weather" and call.call_id and call.id.startswith("fc_")
    assert call.status == "completed" and first.status == "completed"
    assert set(json.loads(call.arguments)) == {"city"}
    with client.responses.stream(
        model=client.model,
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        temperature=0,
    ) as stream:
        events = list(stream)
        streamed = call_of(stream.get_final_response())
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(deltas) == streamed.arguments == call.arguments
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [(d.name, d.arguments) for d in done] == [("get_weather", call.arguments)]
    # The second turn sends the call back with its output, stateless (with a reasoning item
    # passed back, as clients of thinking models do: accepted, not rendered).
    second = ask(
        client,
        input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": []},
            call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 24 C"},
        ],
        tools=[WEATHER],
        max_output_tokens=32,
    )
    assert second.status in ("completed", "incomplete")
    assert second.usage.input_tokens > first.usage.input_tokens
    # A named tool_choice in Responses' flat shape.
    named = ask(
        client,
        input="Hello",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
    )
    assert call_of(named).name == "get_weather"


def test_previous_response_id_continues_the_stored_conversation(client, llm):
    block = llm.engine.kv.block_size
    first = ask(client, input="My name is Ada and I write programs.", max_output_tokens=16)
    second = ask(
        client, previous_response_id=first.id, input="What is my name?", max_output_tokens=8
    )
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + 4
    # The earlier turn's prompt is already in the prefix cache (all its full blocks).
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached >= first.usage.input_tokens // block * block - block
    # It is exactly the conversation sent whole.
    history = [
        {"role": "user", "content": "My name is Ada and I write programs."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"},
    ]
    whole = ask(client, input=history, max_output_tokens=8, store=False)
    assert whole.usage.input_tokens == second.usage.input_tokens
    assert whole.output_text == second.output_text
    # The same, naming the stored answer by its item id.
    history[1] = {"type": "item_reference", "id": first.output[-1].id}
    referenced = ask(client, input=history, max_output_tokens=8, store=False)
    assert referenced.usage.input_tokens == second.usage.input_tokens


def test_get_and_delete_a_stored_response(client):
    r = ask(client, input="Hi", max_output_tokens=4, metadata={"k": "v"})
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.metadata == {"k": "v"}
    client.responses.delete(r.id)
    for gone in (
        lambda: client.responses.retrieve(r.id),
        lambda: client.responses.delete(r.id),
        lambda: ask(client, input="Hi", previous_response_id=r.id),
    ):
        with pytest.raises(openai.NotFoundError, match=r.id):
            gone()
    unstored = ask(client, input="Hi", max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError, match=unstored.id):
        client.responses.retrieve(unstored.id)


def test_events_for_reasoning_text_and_a_call_are_the_sdks_types():
    """A thinking model's answer (the default model does not think): every event and the final
    response validate as the official SDK's types, in the order its stream helper reads them."""
    from openai.types.responses import Response, ResponseStreamEvent

    # The SDK's event union, by each member's `type`.
    members = typing.get_args(typing.get_args(ResponseStreamEvent)[0])
    by_type = {typing.get_args(m.model_fields["type"].annotation)[0]: m for m in members}

    deltas = [
        ChatDelta(0, reasoning="Let me think. "),
        ChatDelta(0, reasoning="Done."),
        ChatDelta(0, content="Calling f."),
        ChatDelta(0, calls=[CallDelta(0, "", "call_1", "f")]),
        ChatDelta(0, calls=[CallDelta(0, '{"a": 1}')], finish_reason="tool_calls"),
    ]
    usage = Usage(prompt_tokens=5, completion_tokens=7, total_tokens=12)
    builder = OutputBuilder(ResponseObject(id="resp_1", created_at=0, model="m"))
    raw = builder.start() + [e for d in deltas for e in builder.feed(d)]
    raw += builder.finish("tool_calls", usage)
    events = [by_type[e["type"]].model_validate(e) for e in raw]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    item = ["response.output_item.added", "response.content_part.added"]
    part_done = ["response.content_part.done", "response.output_item.done"]
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        *item,
        *["response.reasoning_text.delta"] * 2,
        "response.reasoning_text.done",
        *part_done,
        *item,
        "response.output_text.delta",
        "response.output_text.done",
        *part_done,
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    final = Response.model_validate(raw[-1]["response"])
    assert [i.type for i in final.output] == ["reasoning", "message", "function_call"]
    assert final.output[0].content[0].text == "Let me think. Done."
    assert final.output_text == "Calling f." and final.output[2].arguments == '{"a": 1}'
    assert final.status == "completed" and final.usage.total_tokens == 12
    # The same answer whole (as a non-streamed request builds it) gives the same items.
    whole = OutputBuilder(ResponseObject(id="resp_2", created_at=0, model="m"))
    calls = [CallDelta(0, '{"a": 1}', "call_1", "f")]
    whole.feed(ChatDelta(0, "Calling f.", "Let me think. Done.", calls, None, "tool_calls"))
    whole.finish("tool_calls", usage)
    strip = {"__all__": {"id"}}
    assert whole.response.model_dump(include={"output"}, exclude={"output": strip}) == (
        builder.response.model_dump(include={"output"}, exclude={"output": strip})
    )


def test_the_store_is_bounded_and_forgets_the_least_recently_used():
    store = ResponseStore(capacity=2)
    for name in ("a", "b"):
        store.put(StoredResponse(ResponseObject(id=name, created_at=0, model="m"), []))
    store.get("a")  # now "b" is the least recently used
    store.put(StoredResponse(ResponseObject(id="c", created_at=0, model="m"), []))
    assert store.get("a").response.id == "a" and store.get("c").response.id == "c"
    with pytest.raises(APIError, match="'b'") as e:
        store.get("b", param="previous_response_id")
    assert e.value.status == 404 and e.value.param == "previous_response_id"


@pytest.mark.parametrize(
    ("body", "status", "param", "says"),
    [
        (
            {"input": [{"role": "user", "content": "Hi"}, {"type": "bogus"}]},
            400,
            "input.1.type",
            "bogus",
        ),
        (
            {"input": "Hi", "previous_response_id": "resp_nope"},
            404,
            "previous_response_id",
            "resp_nope",
        ),
        ({"input": "Hi", "tools": [{"type": "web_search"}]}, 400, "tools.0.type", "web_search"),
        ({"input": [{"type": "item_reference", "id": "msg_x"}]}, 404, "input.0.id", "msg_x"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            400,
            "input.0.content.0.type",
            "input_image",
        ),
        ({"input": [{"type": "function_call", "name": "f"}]}, 400, "input.0.call_id", "call_id"),
        ({"input": "Hi", "tool_choice": "required"}, 400, "tool_choice", "tools"),
        ({"input": "Hi", "max_output_tokens": 0}, 400, "max_output_tokens", "max_output_tokens"),
        ({"input": "Hi", "text": {"format": {"type": "yaml"}}}, 400, "text.format.type", "yaml"),
        (
            {"input": "Hi", "tools": [WEATHER | {"parameters": {"$ref": "#/$defs/Nowhere"}}]},
            400,
            "tools",
            "tools.0.parameters",
        ),
        ({"input": "Hi", "temperature": "hot"}, 400, "temperature", "temperature"),
        ({}, 400, "input", "input"),
    ],
)
def test_bad_input_names_the_field_and_the_server_keeps_serving(
    client, base_url, body, status, param, says
):
    r = httpx.post(f"{base_url}/v1/responses", json=body, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"]
    assert ask(client, input="Hi", max_output_tokens=2).status == "incomplete"


def test_an_engine_failure_fails_the_streamed_response(llm):
    broken = with_engine(llm, _FailingEngine(llm.engine))
    with serving(create_app(broken)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=10)
        events = list(client.responses.create(model=llm.model_name, input="Hi", stream=True))
        assert [e.type for e in events] == [
            "response.created",
            "response.in_progress",
            "response.failed",
        ]
        failed = events[-1].response
        assert failed.status == "failed" and "simulated" in failed.error.message
        with pytest.raises(openai.InternalServerError, match="simulated"):
            client.responses.create(model=llm.model_name, input="Hi")


def test_unknown_fields_are_accepted(base_url, llm):
    body = {
        "model": llm.model_name,
        "input": "Hi",
        "max_output_tokens": 2,
        "service_tier": "auto",
        "prompt_cache_key": "abc",
        "reasoning": {"effort": "low"},
        "include": ["reasoning.encrypted_content"],
        "truncation": "auto",
        "user": "u1",
    }
    r = httpx.post(f"{base_url}/v1/responses", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["truncation"] == "auto" and r.json()["reasoning"] == {"effort": "low"}
    # The body validates as the SDK's type (its client only constructs, without checking).
    from openai.types.responses import Response

    assert Response.model_validate(r.json()).status == "incomplete"


# -- the OpenAI Agents SDK ----------------------------------------------------------------------


class Weather(BaseModel):
    city: str = Field(max_length=20)
    sunny: bool


class Place(BaseModel):
    city: str = Field(max_length=20)
    country: str = Field(max_length=20)


def run_agent(base_url: str, model_name: str, prompt: str, chained: bool = False, **agent_kwargs):
    """An Agent on the SDK's default Responses model class pointed at the server; `chained`:
    each turn continues the last by previous_response_id, sending only what is new."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)

    async def go():
        client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
        model = agents.OpenAIResponsesModel(model=model_name, openai_client=client)
        agent = agents.Agent(name="tester", instructions="Be brief.", model=model, **agent_kwargs)
        try:
            return await agents.Runner.run(
                agent, prompt, max_turns=4, auto_previous_response_id=chained
            )
        finally:
            await client.close()

    return asyncio.run(go())


def agent_settings(**kwargs):
    from agents import ModelSettings

    return ModelSettings(temperature=0, max_tokens=48, **kwargs)


@pytest.mark.parametrize("chained", [False, True], ids=["stateless", "previous_response_id"])
def test_agents_sdk_function_tool_loop(base_url, llm, chained):
    from agents import function_tool

    seen = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        seen.append(city)
        return f"sunny in {city}"

    result = run_agent(
        base_url,
        llm.model_name,
        "What is the weather in Paris?",
        chained=chained,
        tools=[get_weather],
        model_settings=agent_settings(tool_choice="required"),
    )
    kinds = [item.type for item in result.new_items]
    # The forced call ran, its output went back, and the agent ended on text (the SDK resets
    # tool_choice after a call).
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and len(seen) >= 1
    assert kinds[-1] == "message_output_item" and isinstance(result.final_output, str)
    # Each turn's prompt holds the one before: the stored conversation was continued.
    inputs = [r.usage.input_tokens for r in result.raw_responses]
    assert inputs == sorted(inputs) and inputs[0] < inputs[-1]


def test_agents_sdk_streamed_run(base_url, llm):
    """Runner.run_streamed reads the server's events through the SDK's stream."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)

    async def go():
        client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
        model = agents.OpenAIResponsesModel(model=llm.model_name, openai_client=client)
        agent = agents.Agent(
            name="tester", instructions="Be brief.", model=model, model_settings=agent_settings()
        )
        try:
            run = agents.Runner.run_streamed(agent, QUESTION, max_turns=1)
            deltas = [
                e.data.delta
                async for e in run.stream_events()
                if e.type == "raw_response_event" and e.data.type == "response.output_text.delta"
            ]
            return run, "".join(deltas)
        finally:
            await client.close()

    run, text = asyncio.run(go())
    assert text and run.final_output == text


def test_agents_sdk_output_type(base_url, llm):
    result = run_agent(
        base_url,
        llm.model_name,
        "Is it sunny in Paris?",
        output_type=Weather,
        model_settings=agent_settings(),
    )
    assert isinstance(result.final_output, Weather)


def test_agents_sdk_tool_with_a_pydantic_argument(base_url, llm):
    from agents import function_tool

    seen = []

    @function_tool
    def find(place: Place) -> str:
        """Find a place."""
        seen.append(place)
        return "found"

    result = run_agent(
        base_url,
        llm.model_name,
        "Find Paris in France.",
        tools=[find],
        model_settings=agent_settings(tool_choice="required"),
    )
    assert seen and all(isinstance(p, Place) for p in seen)
    assert result.new_items[0].type == "tool_call_item"


def test_agents_sdk_tools_and_output_type(base_url, llm):
    """The SDK sends the tools and the output type's text.format together: every answer is a
    call of the tool or JSON that validates as the output type. The tiny model may call the tool
    on every turn (tool_choice falls back to auto after the first), so the run may end at its turn
    limit, with nothing but valid calls."""
    from agents import function_tool
    from agents.exceptions import MaxTurnsExceeded

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"sunny in {city}"

    try:
        result = run_agent(
            base_url,
            llm.model_name,
            "Is it sunny in Paris?",
            tools=[get_weather],
            output_type=Weather,
            model_settings=agent_settings(tool_choice="required"),
        )
    except MaxTurnsExceeded as e:
        calls = [i.raw_item for i in e.run_data.new_items if i.type == "tool_call_item"]
        assert calls and all(c.name == "get_weather" for c in calls)
        assert all(isinstance(json.loads(c.arguments)["city"], str) for c in calls)
    else:
        assert isinstance(result.final_output, Weather)
