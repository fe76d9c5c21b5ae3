"""A thinking model's thinking never reaches the answer's text in any dialect, streamed or whole:
a random checkpoint with DeepSeek-R1's template (its answers start inside the thinking) and a
thinking budget of 3 tokens (`--reasoning-budget`), so every answer thinks, then answers. Each
client is the official one, unchanged; the same greedy conversation gives the same thinking and
the same answer in every dialect."""

from pathlib import Path

import anthropic
import ollama
import openai
import pytest

from tests.http_server import serving
from tests.test_reasoning import ASK, load, thinking_checkpoint
from tinyllm.entrypoints.server.app import create_app

pytestmark = pytest.mark.slow

MAX_TOKENS = 10


@pytest.fixture(scope="module")
def url(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("r1") / "r1"
    llm = load(thinking_checkpoint(Path(path), "llama-cpp-deepseek-r1.jinja"))
    llm.reasoning_budget = 3
    with serving(create_app(llm)) as base:
        yield base


@pytest.fixture(scope="module")
def reference(url) -> tuple[str, str]:
    """(thinking, answer) from the OpenAI chat dialect, whole."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    out = client.chat.completions.create(
        model=model, messages=ASK, max_tokens=MAX_TOKENS, temperature=0
    )
    message = out.choices[0].message
    thinking = message.model_extra["reasoning_content"]
    assert thinking and message.model_extra["reasoning"] == thinking
    assert "think>" not in (message.content or "")
    return thinking, message.content or ""


def model_name(url: str) -> str:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused").models.list().data[0].id


def test_openai_chat_stream(url, reference):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    thinking, content = "", ""
    for chunk in client.chat.completions.create(
        model=model_name(url), messages=ASK, max_tokens=MAX_TOKENS, temperature=0, stream=True
    ):
        delta = chunk.choices[0].delta
        thinking += delta.model_extra.get("reasoning_content") or ""
        content += delta.content or ""
    assert (thinking, content) == reference


@pytest.mark.parametrize("stream", [False, True])
def test_responses(url, reference, stream):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    kwargs = dict(model=model_name(url), input=ASK[0]["content"], max_output_tokens=MAX_TOKENS)
    if stream:  # the answer is cut at max_output_tokens: the last event is response.incomplete
        events = list(client.responses.create(**kwargs, temperature=0, stream=True))
        assert events[-1].type == "response.incomplete"
        response = events[-1].response
    else:
        response = client.responses.create(**kwargs, temperature=0)
    (reasoning,) = [item for item in response.output if item.type == "reasoning"]
    thinking = "".join(part.text for part in reasoning.content)
    assert (thinking, response.output_text) == reference
    assert response.usage.output_tokens_details.reasoning_tokens == 4  # 3, and </think>


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_messages(url, reference, stream):
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    kwargs = dict(
        model=model_name(url),
        messages=ASK,
        max_tokens=MAX_TOKENS,
        extra_body={"temperature": 0},
    )
    if stream:
        with client.messages.stream(**kwargs) as events:
            message = events.get_final_message()
    else:
        message = client.messages.create(**kwargs)
    blocks = {b.type: b for b in message.content}
    assert blocks["thinking"].thinking == reference[0]
    assert "".join(b.text for b in message.content if b.type == "text") == reference[1]


@pytest.mark.parametrize("stream", [False, True])
def test_ollama_chat(url, reference, stream):
    client = ollama.Client(host=url)
    options = {"temperature": 0, "num_predict": MAX_TOKENS}
    out = client.chat(model=model_name(url), messages=ASK, options=options, stream=stream)
    parts = list(out) if stream else [out]
    thinking = "".join(p.message.thinking or "" for p in parts)
    content = "".join(p.message.content or "" for p in parts)
    assert (thinking, content) == reference
