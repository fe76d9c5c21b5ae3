"""Anthropic's Messages API end to end: the default model behind a real uvicorn, driven by the
official `anthropic` client. The model is tiny: the tests check what the server guarantees
(shapes, validation, reassembly of streams), not what a capable model would answer."""

import json

import anthropic
import httpx
import jsonschema
import pytest
from anthropic.lib.streaming._messages import accumulate_event

from tests.http_server import serving
from tinyllm.entrypoints.server.anthropic import BlockEvents, content_blocks
from tinyllm.entrypoints.server.app import create_app
from tinyllm.entrypoints.server.chat_run import ChatAnswer, ChatDelta
from tinyllm.text.answer import AnswerDelta
from tinyllm.text.tool_calls import CallDelta

pytestmark = pytest.mark.slow

KEY = "test-key"
# This SDK has no temperature argument (newer Claude models fix it); the server takes it.
GREEDY = {"extra_body": {"temperature": 0}}
USER = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"],
    },
}


@pytest.fixture(scope="module")
def server(default_llm):
    with serving(create_app(default_llm, api_key=KEY)) as url:
        yield url


@pytest.fixture(scope="module")
def client(server, default_llm):
    with anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0) as c:
        c.model = default_llm.model_name
        yield c


@pytest.fixture
def still_serving(client):
    """After the test, the server still answers a plain request."""
    yield
    reply = client.messages.create(model=client.model, max_tokens=2, messages=USER)
    assert reply.type == "message" and reply.usage.output_tokens >= 1


def post(server: str, body: dict, path: str = "/v1/messages", **headers) -> httpx.Response:
    return httpx.post(f"{server}{path}", json=body, headers={"x-api-key": KEY, **headers})


def assert_error(r: httpx.Response, status: int, kind: str, *words: str) -> None:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    for w in words:
        assert w in body["error"]["message"], body


def test_create(client):
    m = client.messages.create(
        model=client.model,
        max_tokens=12,
        system=[{"type": "text", "text": "You answer briefly."}],
        messages=USER,
        **GREEDY,
    )
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant"
    assert m.model == client.model
    assert [b.type for b in m.content] == ["text"] and m.content[0].text
    assert m.stop_reason in ("end_turn", "max_tokens") and m.stop_sequence is None
    assert 1 <= m.usage.output_tokens <= 12
    assert m.usage.output_tokens == 12 or m.stop_reason == "end_turn"
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens > 10
    assert m.usage.cache_creation_input_tokens == 0


def test_stream_reassembles_the_message(client):
    body = dict(model=client.model, max_tokens=16, messages=USER, **GREEDY)
    whole = client.messages.create(**body)
    with client.messages.stream(**body) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_delta" in kinds  # the helper does not pass pings on
    drop = {"id": True, "usage": {"input_tokens", "cache_read_input_tokens"}}
    assert streamed.model_dump(exclude=drop) == whole.model_dump(exclude=drop)
    # The same prompt: however much of it the cache held, it is the same size.
    total = streamed.usage.input_tokens + streamed.usage.cache_read_input_tokens
    assert total == whole.usage.input_tokens + whole.usage.cache_read_input_tokens


def test_raw_stream_events(server, client):
    """The SSE frames themselves: event names match the data's type, in Anthropic's order."""
    body = {"model": client.model, "max_tokens": 4, "messages": USER, "stream": True}
    with httpx.stream("POST", f"{server}/v1/messages", json=body, headers={"x-api-key": KEY}) as r:
        assert r.status_code == 200
        frames = [f for f in r.read().decode().split("\n\n") if f]
    events = []
    for frame in frames:
        name, data = frame.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        event = json.loads(data.removeprefix("data: "))
        assert event["type"] == name.removeprefix("event: ")
        events.append(event)
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["message_start", "ping"]
    assert kinds[-2:] == ["message_delta", "message_stop"]
    assert events[-2]["usage"]["output_tokens"] == 4
    assert events[-2]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}


@pytest.mark.parametrize("stream", [False, True])
def test_tool_loop(client, stream):
    body = dict(
        model=client.model,
        max_tokens=64,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER],
        tool_choice={"type": "any"},
        **GREEDY,
    )
    if stream:
        with client.messages.stream(**body) as s:
            first = s.get_final_message()
    else:
        first = client.messages.create(**body)
    assert first.stop_reason == "tool_use"
    calls = [b for b in first.content if b.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert calls[0].id.startswith("toolu_")
    jsonschema.validate(calls[0].input, WEATHER["input_schema"])

    result = {"type": "tool_result", "tool_use_id": calls[0].id, "content": "18 C, sunny"}
    second = client.messages.create(
        model=client.model,
        max_tokens=16,
        messages=[*body["messages"], first.to_param(), {"role": "user", "content": [result]}],
        tools=[WEATHER],
        **GREEDY,
    )
    assert second.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in second.content] == ["text"]


def test_named_tool_and_tool_result_blocks(client):
    m = client.messages.create(
        model=client.model,
        max_tokens=64,
        messages=USER,
        tools=[WEATHER, {**WEATHER, "name": "other"}],
        tool_choice={"type": "tool", "name": "other", "disable_parallel_tool_use": True},
    )
    assert [(b.type, b.name) for b in m.content] == [("tool_use", "other")]
    result = {
        "type": "tool_result",
        "tool_use_id": m.content[0].id,
        "content": [{"type": "text", "text": "no data"}],
        "is_error": True,
    }
    after = [*USER, m.to_param(), {"role": "user", "content": [result]}]
    count = client.messages.count_tokens(model=client.model, messages=after, tools=[WEATHER])
    assert count.input_tokens > 0


def test_count_tokens_is_the_prompt(client):
    body = dict(
        model=client.model,
        system="You answer briefly.",
        messages=[{"role": "user", "content": [{"type": "text", "text": "Weather in Rome?"}]}],
        tools=[WEATHER],
    )
    count = client.messages.count_tokens(**body)
    m = client.messages.create(max_tokens=1, **body)
    usage = m.usage
    assert count.input_tokens == usage.input_tokens + usage.cache_read_input_tokens
    # The tools are part of the prompt.
    bare = client.messages.count_tokens(model=client.model, messages=body["messages"])
    assert bare.input_tokens < count.input_tokens


def test_stop_sequences(client):
    body = dict(model=client.model, max_tokens=32, messages=USER, **GREEDY)
    free = client.messages.create(**body).content[0].text
    words = free.split()
    assert len(words) >= 2, free
    stop = " " + words[1]  # cuts the answer after its first word
    for streamed in (False, True):
        if streamed:
            with client.messages.stream(**body, stop_sequences=[stop]) as s:
                m = s.get_final_message()
        else:
            m = client.messages.create(**body, stop_sequences=[stop])
        assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
        assert m.content[0].text == free[: free.index(stop)]


def test_wrong_or_missing_key(server, client, still_serving):
    with anthropic.Anthropic(base_url=server, api_key="wrong", max_retries=0) as bad:
        with pytest.raises(anthropic.AuthenticationError) as e:
            bad.messages.create(model=client.model, max_tokens=2, messages=USER)
    assert e.value.status_code == 401
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "authentication_error"
    r = httpx.post(f"{server}/v1/messages/count_tokens", json={})
    assert_error(r, 401, "authentication_error", "API key")
    # The bearer token OpenAI's clients send works here too.
    body = {"model": client.model, "messages": USER}
    r = httpx.post(
        f"{server}/v1/messages/count_tokens", json=body, headers={"Authorization": f"Bearer {KEY}"}
    )
    assert r.status_code == 200 and r.json()["input_tokens"] > 0


def test_missing_max_tokens(server, client, still_serving):
    assert_error(
        post(server, {"model": client.model, "messages": USER}),
        400,
        "invalid_request_error",
        "max_tokens",
    )


@pytest.mark.parametrize(
    "block, words",
    [
        ({"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}, ["'image'", ".1"]),
        ({"type": "document", "source": {"type": "text", "data": "x"}}, ["'document'", ".1"]),
    ],
)
def test_unserved_block(server, client, still_serving, block, words):
    content = [{"type": "text", "text": "What is this?"}, block]
    body = {
        "model": client.model,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": content}],
    }
    assert_error(post(server, body), 400, "invalid_request_error", "messages.0.content.1", *words)
    with pytest.raises(anthropic.BadRequestError, match="image"):
        client.messages.create(
            model=client.model,
            max_tokens=4,
            messages=[{"role": "user", "content": [{**content[1], "type": "image"}]}],
        )


@pytest.mark.parametrize(
    "change, status, kind, words",
    [
        (
            {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
            400,
            "invalid_request_error",
            ["tools.0.type", "web_search_20250305"],
        ),
        (
            {"tools": [{"name": "f", "input_schema": {"type": "nonsense"}}]},
            400,
            "invalid_request_error",
            ["tools.0.input_schema"],
        ),
        ({"tool_choice": {"type": "any"}}, 400, "invalid_request_error", ["tool_choice"]),
        ({"max_tokens": "5"}, 400, "invalid_request_error", ["max_tokens"]),
        ({"model": "claude-nonexistent"}, 404, "not_found_error", ["claude-nonexistent"]),
        ({"messages": []}, 400, "invalid_request_error", ["messages"]),
    ],
)
def test_bad_requests_in_anthropic_shape(
    server, client, still_serving, change, status, kind, words
):
    body = {"model": client.model, "max_tokens": 4, "messages": USER, **change}
    assert_error(post(server, body), status, kind, *words)


def test_unknown_route_and_openai_routes_keep_their_shape(server, client):
    assert_error(post(server, {}, "/v1/messages/nothing"), 404, "not_found_error")
    r = httpx.post(f"{server}/v1/chat/completions", json={}, headers={"x-api-key": KEY})
    assert r.status_code == 400 and set(r.json()) == {"error"}


def test_output_config_format(client):
    schema = {
        "type": "object",
        "properties": {"capital": {"type": "string", "maxLength": 20}},
        "required": ["capital"],
        "additionalProperties": False,
    }
    m = client.messages.create(
        model=client.model,
        max_tokens=64,
        messages=USER,
        output_config={"format": {"type": "json_schema", "schema": schema}},
    )
    assert m.stop_reason == "end_turn"
    jsonschema.validate(json.loads(m.content[0].text), schema)


def test_body_over_the_limit_in_anthropic_shape(server, still_serving):
    big = {"messages": [{"role": "user", "content": "x" * (5 << 20)}]}
    assert_error(post(server, big), 413, "request_too_large", "limit")


def test_thinking_text_and_calls_stream_as_the_whole_message():
    """Every kind of block in one answer (the default model does not think): its stream events,
    accumulated by the SDK's own stream helper code, give the blocks of the whole answer."""
    deltas = [
        ChatDelta(0, reasoning="Let me"),
        ChatDelta(0, reasoning=" think.", content="Calling"),
        ChatDelta(0, content=" it.", calls=[CallDelta(0, '{"city": "Pa', "call_1", "get_weather")]),
        ChatDelta(0, calls=[CallDelta(0, 'ris", "unit": "C"}')]),
        ChatDelta(0, calls=[CallDelta(1, "", "call_2", "other"), CallDelta(1, "{}")]),
    ]
    answer, blocks = ChatAnswer(), BlockEvents()
    events = ['event: message_start\ndata: {"type": "message_start", "message": {"id": "msg_1", '
              '"type": "message", "role": "assistant", "model": "m", "content": [], '
              '"usage": {"input_tokens": 1, "output_tokens": 0}}}\n\n']  # fmt: skip
    for d in deltas:
        answer.add(AnswerDelta(d.content, d.reasoning, d.calls))
        events += blocks.feed(d)
    events += blocks.close()
    snapshot, json_bufs = None, {}
    for e in events:
        data = json.loads(e.split("\ndata: ", 1)[1])
        snapshot = accumulate_event(event=data, current_snapshot=snapshot, json_bufs=json_bufs)
    kinds = [json.loads(e.split("\ndata: ", 1)[1])["type"] for e in events]
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 4
    streamed = [b.model_dump(exclude_none=True) for b in snapshot.content]
    assert streamed == [b.model_dump() for b in content_blocks(answer)]
    assert [b["type"] for b in streamed] == ["thinking", "text", "tool_use", "tool_use"]
    assert streamed[2]["input"] == {"city": "Paris", "unit": "C"}
