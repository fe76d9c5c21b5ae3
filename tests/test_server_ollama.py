"""Ollama's native API end to end: the default model behind tinyllm's server, driven by the
official `ollama` Python client (and httpx where the client has no call for a route)."""

import json
from types import SimpleNamespace

import httpx
import jsonschema
import ollama
import pytest

from tests.http_server import serving
from tests.test_server import _StumblingEngine
from tinyllm.entrypoints.server.app import create_app
from tinyllm.entrypoints.server.ollama import chat_messages, ollama_calls
from tinyllm.entrypoints.server.ollama_protocol import Message
from tinyllm.text.tool_calls import ToolCall

pytestmark = pytest.mark.slow

HELLO = [{"role": "user", "content": "Write a long poem about the sea."}]
GREEDY = {"temperature": 0, "num_predict": 12}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="module")
def engine(default_llm):
    return _StumblingEngine(default_llm.engine)


@pytest.fixture(scope="module")
def url(default_llm, engine):
    llm = SimpleNamespace(**vars(default_llm))
    llm.engine = engine
    llm.get_default_sampling_params = default_llm.get_default_sampling_params
    with serving(create_app(llm)) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return ollama.Client(host=url)


@pytest.fixture(scope="module")
def name(default_llm):
    return default_llm.model_name


def test_root_answers_as_ollama(url):
    r = httpx.get(url)
    assert r.status_code == 200 and r.text == "Ollama is running"
    assert httpx.head(url).status_code == 200


def test_list_show_ps_version(client, url, name, default_llm):
    (model,) = client.list().models
    assert model.model == f"{name}:latest"
    assert model.size == default_llm.model_path.stat().st_size
    assert model.details.family == "llama" and model.details.format == "gguf"
    assert model.details.parameter_size == "135M"  # SmolLM2-135M
    assert len(model.digest) == 64

    shown = client.show(name)
    assert shown.template == default_llm.tokenizer.chat_template
    assert "tools" in shown.capabilities and "completion" in shown.capabilities
    info = shown.modelinfo
    assert info["llama.context_length"] == 8192
    assert info["llama.embedding_length"] == 576 and info["llama.block_count"] == 30
    assert shown.details.quantization_level == "F32"  # default_llm: fp32, not quantized

    (running,) = client.ps().models
    assert running.model == f"{name}:latest" and running.expires_at.year > 2100
    assert httpx.get(f"{url}/api/ps").json()["models"][0]["context_length"] == 2048
    assert httpx.get(f"{url}/api/version").json()["version"]


def test_chat_streamed_joins_to_whole(client, name):
    whole = client.chat(name, HELLO, options=GREEDY)
    assert whole.done and whole.done_reason == "length" and whole.message.role == "assistant"
    assert whole.eval_count == 12 and whole.prompt_eval_count > 5
    assert whole.total_duration >= whole.prompt_eval_duration + whole.eval_duration > 0
    assert whole.load_duration == 0 and whole.created_at.endswith("Z")

    parts = list(client.chat(f"{name}:latest", HELLO, options=GREEDY, stream=True))
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert "".join(p.message.content for p in parts) == whole.message.content
    last = parts[-1]
    assert last.done_reason == "length" and last.eval_count == 12
    assert last.eval_duration > 0 and last.prompt_eval_duration > 0


def test_generate_and_raw(client, name, default_llm):
    out = client.generate(name, "Say hello.", system="Be brief.", options=GREEDY)
    assert out.done and out.eval_count == 12 and out.response
    streamed = client.generate(name, "Say hello.", system="Be brief.", options=GREEDY, stream=True)
    assert "".join(p.response for p in streamed) == out.response

    raw = client.generate(name, "The capital of France is", raw=True, options=GREEDY)
    # raw: no template, so the prompt is the plain text's tokens (with the BOS the model adds)
    assert raw.prompt_eval_count == len(default_llm.tokenizer.encode("The capital of France is"))
    assert raw.eval_count == 12 and raw.done_reason == "length"


def test_format_schema_and_json(client, name):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
        "required": ["city", "population"],
    }
    options = {"temperature": 0, "num_predict": 200}
    out = client.chat(name, HELLO, format=schema, options=options)
    jsonschema.validate(json.loads(out.message.content), schema)
    short = {"temperature": 0, "num_predict": 40}
    out = client.generate(name, "List three colours as JSON.", format="json", options=short)
    # Whole JSON once the model ends it; cut by num_predict, the start of an object.
    if out.done_reason == "stop":
        assert isinstance(json.loads(out.response), dict)
    else:
        assert out.done_reason == "length" and out.response.lstrip().startswith("{")


def test_tools_come_back_as_objects(client, name):
    # Ollama has no tool_choice to force a call; greedy, the default model copies one it is
    # shown, and the server's grammar holds it to the tool's schema once started.
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    ask = [{"role": "user", "content": f"Repeat exactly this text and nothing else:\n{call}"}]
    options = {"temperature": 0, "num_predict": 40}
    out = client.chat(name, ask, tools=[WEATHER], options=options)
    (called,) = out.message.tool_calls
    assert called.function.name == "get_weather" and called.function.arguments == {"city": "Paris"}
    assert "<tool_call>" not in out.message.content and out.done_reason == "stop"
    parts = list(client.chat(name, ask, tools=[WEATHER], options=options, stream=True))
    streamed = [c for p in parts for c in p.message.tool_calls or []]
    assert streamed == out.message.tool_calls and parts[-1].done_reason == "stop"
    assert "".join(p.message.content for p in parts) == out.message.content
    # the call goes back with its result, and the conversation continues
    history = [
        *ask,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": "18 C, sunny", "tool_name": "get_weather"},
    ]
    out = client.chat(name, history, tools=[WEATHER], options=GREEDY)
    assert out.done and out.eval_count > 0


def test_messages_translate_to_openai():
    messages = [
        Message(role="user", content="weather?"),
        Message.model_validate(
            {
                "role": "assistant",
                "tool_calls": [{"function": {"name": "w", "arguments": {"city": "Paris"}}}],
            }
        ),
        Message(role="tool", content="sunny", tool_name="w"),
    ]
    user, assistant, tool = chat_messages(messages)
    assert user == {"role": "user", "content": "weather?"}
    (call,) = assistant["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert call["function"]["name"] == "w" and tool["tool_call_id"] == call["id"]


def test_calls_translate_to_ollama():
    calls = [
        ToolCall("get_weather", '{"city": "Paris", "days": [1, 2]}'),
        ToolCall("get_weather", '{"city": "Pa', complete=False),  # cut by num_predict
    ]
    assert ollama_calls(calls) == [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}}
    ]
    # what the official client reads back
    message = ollama.Message(role="assistant", tool_calls=ollama_calls(calls))
    assert message.tool_calls[0].function.arguments["city"] == "Paris"


def test_options(client, name):
    out = client.generate(name, "Tell me a story.", options={"num_predict": 3, "temperature": 0})
    assert out.eval_count == 3 and out.done_reason == "length"
    sampled = {"temperature": 1.0, "seed": 42, "num_predict": 16, "top_k": 50, "min_p": 0.01}
    a = client.generate(name, "Tell me a story.", options=sampled)
    b = client.generate(name, "Tell me a story.", options=sampled)
    assert a.response == b.response
    free = client.generate(name, "Tell me a story.", options={"temperature": 0, "num_predict": 30})
    word = free.response.split()[2]
    stopped = client.generate(
        name, "Tell me a story.", options={"temperature": 0, "num_predict": 30, "stop": [word]}
    )
    assert word not in stopped.response and stopped.done_reason == "stop"
    assert free.response.startswith(stopped.response)
    # num_predict past the context, num_ctx past it, and unknown options: all accepted
    big = {"temperature": 0, "num_predict": 100000, "num_ctx": 100000, "mirostat": 0}
    out = client.chat(name, [{"role": "user", "content": "Hi"}], options=big)
    assert out.done


def _error(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, r.text
    assert list(r.json()) == ["error"]
    return r.json()["error"]


def test_errors_in_ollama_shape(url, client, name):
    with pytest.raises(ollama.ResponseError) as e:
        client.chat("nope", HELLO)
    assert e.value.status_code == 404 and e.value.error == "model 'nope' not found"
    image = {"role": "user", "content": "what is this?", "images": ["aGVsbG8="]}
    r = httpx.post(f"{url}/api/chat", json={"model": name, "messages": [image]})
    assert "images" in _error(r, 400)
    body = {"model": name, "messages": HELLO, "options": {"temperature": "hot"}}
    assert "options.temperature" in _error(httpx.post(f"{url}/api/chat", json=body), 400)
    body = {"model": name, "prompt": "x", "suffix": "y"}
    assert "suffix" in _error(httpx.post(f"{url}/api/generate", json=body), 400)
    assert "not found" in _error(httpx.post(f"{url}/api/show", json={"model": "x"}), 404)
    r = httpx.post(f"{url}/api/chat", content=b"{", headers={"content-type": "application/json"})
    _error(r, 400)
    # and the server keeps serving
    assert client.chat(name, HELLO, options={"num_predict": 2}).eval_count == 2


def test_think_and_keep_alive(url, client, name):
    # The default model does not think: think true is refused by name, false is accepted.
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(name, HELLO, think=True)
    assert e.value.status_code == 400 and "does not support thinking" in e.value.error
    out = client.chat(name, HELLO, think=False, keep_alive="5m", options={"num_predict": 2})
    assert out.done and out.message.thinking is None
    # a client that sends content null (an assistant turn with calls only)
    turns = [*HELLO, {"role": "assistant", "content": None}, {"role": "user", "content": "Go on"}]
    body = {"model": name, "messages": turns, "stream": False, "options": {"num_predict": 2}}
    assert httpx.post(f"{url}/api/chat", json=body).json()["eval_count"] == 2


def test_an_engine_fault_ends_the_stream_with_an_error_line(url, client, name, engine):
    engine.stumble = True
    with pytest.raises(ollama.ResponseError, match="simulated fault"):
        list(client.chat(name, HELLO, options=GREEDY, stream=True))
    engine.stumble = True
    body = {"model": name, "prompt": "Hi", "options": GREEDY}
    with httpx.stream("POST", f"{url}/api/generate", json=body) as r:
        assert r.headers["content-type"] == "application/x-ndjson"
        lines = [json.loads(line) for line in r.iter_lines()]
    assert "simulated fault" in lines[-1]["error"]
    assert client.chat(name, HELLO, options={"num_predict": 2}).eval_count == 2


def test_load_requests(url, name):
    r = httpx.post(f"{url}/api/generate", json={"model": name})
    assert r.json()["done_reason"] == "load" and r.json()["done"]
    r = httpx.post(f"{url}/api/chat", json={"model": name, "messages": []})
    assert r.json()["done_reason"] == "load"


def test_what_no_handler_answers_is_in_ollamas_shape_too(default_llm):
    """An unknown /api route and a wrong API key: Ollama's {"error": ...}, as its clients read."""
    with serving(create_app(default_llm, api_key="k")) as url:
        r = httpx.get(f"{url}/api/nothing", headers={"Authorization": "Bearer k"})
        assert r.status_code == 404 and set(r.json()) == {"error"}
        r = httpx.post(f"{url}/api/chat", json={"model": "x", "messages": []})
        assert r.status_code == 401 and "API key" in r.json()["error"]
