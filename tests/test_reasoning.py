"""Thinking models end to end: a small random Qwen3 checkpoint with the real Qwen3 chat template
(tests/data/templates), its tokenizer the default model's plus Qwen's `<think>`, `</think>`,
`<tool_call>`, `</tool_call>` tokens. A random model does not think on its own: logit_bias makes
it open `<think>` (and never close it itself, where the budget must), and the engine's own
output is what the parser splits."""

import dataclasses
import json
from pathlib import Path
from typing import Literal

import gguf
import jsonschema
import pydantic
import pytest

from tests.http_server import openai_client
from tests.test_hf_loader import _random_hf_model
from tinyllm import LLM, SamplingParams
from tinyllm.loaders.source import default_model_path
from tinyllm.text.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

TEMPLATES = Path(__file__).parent / "data" / "templates"
ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
ASK = [{"role": "user", "content": "Which city is the capital of France?"}]
SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}, "sure": {"type": "boolean"}},
    "required": ["city", "sure"],
}


def thinking_checkpoint(
    path: Path,
    template: str,
    special: tuple[str, ...] = (),
    family: str = "Qwen3",
    **overrides,
) -> Path:
    """A random checkpoint of `family` (a tiny Qwen3) with chat `template`, `<think>` and
    `<tool_call>` tags added to the default model's vocabulary, and `special` as special
    tokens."""
    tok = Tokenizer.from_gguf(gguf.GGUFReader(default_model_path()))
    backend = tok.backend
    backend.add_tokens(ADDED)
    backend.add_special_tokens(list(special))
    path.mkdir()
    backend.save(str(path / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "add_bos_token": False}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "chat_template.jinja").write_text((TEMPLATES / template).read_text())
    ids = dict(bos_token_id=None, eos_token_id=backend.token_to_id("<|im_end|>"), pad_token_id=0)
    shape = dict(head_dim=16, tie_word_embeddings=True, max_position_embeddings=1024)
    model = _random_hf_model(
        family, vocab_size=backend.get_vocab_size(), **{**shape, **ids, **overrides}
    )
    model.save_pretrained(path, safe_serialization=True)
    return path


def load(path: Path) -> LLM:
    return LLM(str(path), "float32", quantization="none", max_model_len=512, num_blocks=256)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> LLM:
    return load(
        thinking_checkpoint(tmp_path_factory.mktemp("q") / "qwen3", "Qwen-Qwen3-0.6B.jinja")
    )


@pytest.fixture(scope="module")
def ids(qwen3: LLM) -> tuple[int, int]:
    tok = qwen3.tokenizer
    return tok.token_to_id("<think>"), tok.token_to_id("</think>")


def thinks(ids: tuple[int, int]) -> dict[int, float]:
    """Opens <think> at once, and never closes it by itself."""
    return {ids[0]: 100.0, ids[1]: -100.0}


def test_template_makes_a_thinking_model(qwen3: LLM) -> None:
    assert qwen3.reasoning is not None and not qwen3.reasoning.starts_inside


# -- the Python API (before the server tests: their engine loop then owns the engine) ----------


def test_llm_chat_keeps_the_thinking_apart(qwen3: LLM, ids) -> None:
    qwen3.reasoning_budget = 5
    try:
        params = SamplingParams(temperature=0, max_tokens=12, logit_bias=thinks(ids))
        (out,) = qwen3.chat(ASK, params, use_tqdm=False)
    finally:
        qwen3.reasoning_budget = None
    c = out.outputs[0]
    # The budget closed the thinking after exactly 5 tokens.
    assert c.token_ids[0] == ids[0] and c.token_ids[6] == ids[1]
    thought = qwen3.tokenizer.decode(c.token_ids[1:6]).strip()
    assert c.reasoning == thought and thought
    answer = qwen3.tokenizer.decode(c.token_ids[7:]).lstrip()
    assert c.text == answer
    assert "<think>" not in c.text and "</think>" not in c.text


def test_llm_chat_template_kwargs_turn_thinking_off(qwen3: LLM, ids) -> None:
    params = SamplingParams(temperature=0, max_tokens=4)
    off = {"enable_thinking": False}
    (out,) = qwen3.chat(ASK, params, use_tqdm=False, chat_template_kwargs=off)
    assert out.prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # The prompt closed the thinking: even a model that writes <think> is answering.
    forced = dataclasses.replace(params, logit_bias={ids[0]: 100.0})
    (out,) = qwen3.chat(ASK, forced, use_tqdm=False, chat_template_kwargs=off)
    assert out.outputs[0].reasoning == ""
    assert out.outputs[0].text.startswith("<think>")
    with pytest.raises(ValueError, match="chat_template_kwargs: 'messages'"):
        qwen3.chat(ASK, params, use_tqdm=False, chat_template_kwargs={"messages": []})


def test_deepseek_r1_answers_start_inside_the_thinking(tmp_path: Path) -> None:
    llm = load(thinking_checkpoint(tmp_path / "r1", "llama-cpp-deepseek-r1.jinja"))
    end = llm.tokenizer.token_to_id("</think>")
    llm.reasoning_budget = 3
    params = SamplingParams(temperature=0, max_tokens=8, logit_bias={end: -100.0})
    (out,) = llm.chat(ASK, params, use_tqdm=False)
    assert out.prompt.endswith("<｜Assistant｜><think>\n")
    c = out.outputs[0]
    assert c.token_ids[3] == end  # no opening tag: the prompt wrote it
    assert c.reasoning == llm.tokenizer.decode(c.token_ids[:3]).strip() and c.reasoning
    assert c.text == llm.tokenizer.decode(c.token_ids[4:]).lstrip()


# -- the OpenAI chat dialect --------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(qwen3: LLM):
    with openai_client(qwen3) as c:
        yield c


def reasoning_of(message) -> tuple[str | None, str | None]:
    return message.model_extra.get("reasoning_content"), message.model_extra.get("reasoning")


def test_thinking_never_reaches_content_whole_or_streamed(client, ids) -> None:
    body = dict(
        model=client.model,
        messages=ASK,
        max_tokens=16,
        temperature=0,
        logprobs=True,
        logit_bias={str(i): b for i, b in thinks(ids).items()},
        extra_body={"thinking_token_budget": 6},
    )
    whole = client.chat.completions.create(**body)
    message = whole.choices[0].message
    reasoning, also = reasoning_of(message)
    assert reasoning and also == reasoning
    tokens = [t.token for t in whole.choices[0].logprobs.content]
    assert tokens[0] == "<think>" and tokens[7] == "</think>"  # closed at the budget
    assert "<think>" not in (message.content or "") and "</think>" not in (message.content or "")
    assert reasoning not in (message.content or "")
    assert whole.usage.completion_tokens_details.reasoning_tokens == 8
    assert whole.usage.completion_tokens == 16

    chunks = list(
        client.chat.completions.create(**body, stream=True, stream_options={"include_usage": True})
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    content = "".join(d.content or "" for d in deltas)
    streamed = "".join(d.model_extra.get("reasoning_content") or "" for d in deltas)
    assert "".join(d.model_extra.get("reasoning") or "" for d in deltas) == streamed
    assert (streamed, content) == (reasoning, message.content or "")
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == 8


def test_json_schema_after_thinking_validates(client, ids) -> None:
    body = dict(
        model=client.model,
        messages=ASK,
        max_tokens=40,
        temperature=0,
        logit_bias={str(i): b for i, b in thinks(ids).items()},
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": SCHEMA},
        },
        extra_body={"thinking_token_budget": 4},
    )
    whole = client.chat.completions.create(**body)
    message = whole.choices[0].message
    assert reasoning_of(message)[0]
    jsonschema.validate(json.loads(message.content), SCHEMA)
    assert whole.choices[0].finish_reason == "stop"

    class Answer(pydantic.BaseModel):
        city: Literal["Paris", "Rome", "Oslo"]
        sure: bool

    body["response_format"] = Answer
    parsed = client.chat.completions.parse(**body).choices[0].message
    assert isinstance(parsed.parsed, Answer) and reasoning_of(parsed)[0]


@pytest.mark.parametrize(
    "extra",
    [{"chat_template_kwargs": {"enable_thinking": False}}, {"enable_thinking": False}],
    ids=["chat_template_kwargs", "enable_thinking"],
)
def test_thinking_off_gives_no_reasoning(client, ids, extra) -> None:
    whole = client.chat.completions.create(
        model=client.model,
        messages=ASK,
        max_tokens=4,
        temperature=0,
        logit_bias={str(ids[0]): 100.0},  # a <think> now is answer text, not thinking
        extra_body=extra,
    )
    message = whole.choices[0].message
    assert reasoning_of(message) == (None, None)
    assert message.content.startswith("<think>")
    assert whole.usage.completion_tokens_details.reasoning_tokens == 0


def test_include_reasoning_false_leaves_it_out(client, ids) -> None:
    whole = client.chat.completions.create(
        model=client.model,
        messages=ASK,
        max_tokens=10,
        temperature=0,
        logit_bias={str(i): b for i, b in thinks(ids).items()},
        extra_body={"thinking_token_budget": 3, "include_reasoning": False},
    )
    message = whole.choices[0].message
    assert reasoning_of(message) == (None, None)
    assert "<think>" not in (message.content or "")
    assert whole.usage.completion_tokens_details.reasoning_tokens == 5


def test_bad_reasoning_fields_are_400s_naming_them(client) -> None:
    import openai

    base = dict(model=client.model, messages=ASK, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs") as e:
        client.chat.completions.create(**base, extra_body={"chat_template_kwargs": {"tools": 1}})
    assert e.value.body["param"] == "chat_template_kwargs"
    with pytest.raises(openai.BadRequestError, match="thinking_token_budget"):
        client.chat.completions.create(**base, extra_body={"thinking_token_budget": -1})
    # The server keeps serving.
    assert client.chat.completions.create(**base).choices[0].finish_reason == "length"


# Last: the failure it shows stops the engine's request with an internal error.
def test_tool_call_after_thinking(client, ids) -> None:
    tool = {
        "type": "function",
        "function": {
            "name": "capital",
            "parameters": {
                "type": "object",
                "properties": {"country": {"enum": ["France", "Italy"]}},
                "required": ["country"],
            },
        },
    }
    whole = client.chat.completions.create(
        model=client.model,
        messages=ASK,
        max_tokens=60,
        temperature=0,
        tools=[tool],
        tool_choice="required",
        logit_bias={str(i): b for i, b in thinks(ids).items()},
        extra_body={"thinking_token_budget": 3},
    )
    message = whole.choices[0].message
    assert reasoning_of(message)[0]
    assert not message.content
    (call,) = message.tool_calls
    assert call.function.name == "capital"
    assert json.loads(call.function.arguments)["country"] in ("France", "Italy")
    assert whole.choices[0].finish_reason == "tool_calls"
