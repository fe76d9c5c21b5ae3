"""The OpenAI-compatible server end to end: the real default model behind a real uvicorn on an
ephemeral port, driven by the official openai client. A request the server runs alone must give
exactly LLM.generate's greedy answer; batched ones may only differ at a near-tie (tests/greedy.py).
"""

import asyncio
import time
from types import SimpleNamespace

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.greedy import assert_greedy_close
from tests.http_server import serving
from tinyllm import SamplingParams
from tinyllm.engine.engine import EngineStats, LLMEngine
from tinyllm.entrypoints.server.app import create_app

pytestmark = pytest.mark.slow

# 64 different openings that the model continues for a while rather than stopping at once.
_TOPICS = ["the sea", "a robot", "the moon", "coffee", "a dragon", "winter", "music", "a city"]
_OPENINGS = [
    "Once upon a time, there was",
    "Here is a poem about",
    "Three facts about",
    "My favourite thing about",
    "A short story about",
    "The history of",
    "Why people love",
    "The problem with",
]
PROMPTS = [f"{opening} {topic}" for opening in _OPENINGS for topic in _TOPICS]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
CONCURRENT_TOKENS = 8
TOP = 5  # logprobs asked for where batching could flip a near-tie


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=TOP)


@pytest.fixture(scope="module")
def llm(default_llm):
    return default_llm


@pytest.fixture(scope="module")
def offline(llm):
    """Greedy references, run before the server's engine thread takes over the engine: the
    64 prompts as one batch, and a few alone (as the server runs a lone request)."""
    completions = llm.generate(PROMPTS, greedy(CONCURRENT_TOKENS), use_tqdm=False)
    long = [llm.generate(p, greedy(16), use_tqdm=False)[0] for p in PROMPTS[:2]]
    chat = llm.chat(CHAT, greedy(16), use_tqdm=False)[0]
    scored = SamplingParams(temperature=0, max_tokens=4, logprobs=2, prompt_logprobs=2)
    echo = llm.generate(PROMPTS[1], scored, use_tqdm=False)[0]
    return SimpleNamespace(completions=completions, long=long, chat=chat, echo=echo)


@pytest.fixture(scope="module")
def base_url(llm, offline):
    with serving(create_app(llm)) as url:
        yield url


@pytest.fixture
def client(base_url, llm):
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0) as c:
        c.model = llm.model_name
        yield c


def metrics(base_url: str) -> dict[str, float]:
    """Every sample of /metrics, by name plus labels."""
    text = httpx.get(f"{base_url}/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def assert_close_to(llm, ref, text: str, logprobs: list) -> None:
    """`text` and its completions-API `logprobs` chunks are `ref`'s greedy answer, but for a
    near-tie flip; compared by token text, which is all the API returns."""

    def piece(token_id: int) -> str:
        return llm.tokenizer.decode([token_id], skip_special_tokens=False)

    ref_tokens = [piece(t) for t in ref.token_ids]
    ref_tops = [
        {piece(t): v for t, v in lp.top} | {piece(lp.token_id): lp.logprob}
        for lp in ref.outputs[0].logprobs
    ]
    tokens = [t for lp in logprobs for t in lp.tokens]
    tops = [
        top | {t: v}
        for lp in logprobs
        for t, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True)
    ]
    assert_greedy_close(ref_tokens, ref_tops, tokens, tops, label=repr(ref.prompt))
    if tokens == ref_tokens:
        assert text == ref.text


def test_completion_matches_offline_greedy(client, offline):
    ref = offline.long[0]
    r = client.completions.create(
        model=client.model, prompt=PROMPTS[0], max_tokens=16, temperature=0
    )
    assert r.choices[0].text == ref.text
    assert r.usage.completion_tokens == len(ref.token_ids)
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.choices[0].finish_reason == ref.finish_reason


def test_completion_stream_matches_offline_greedy(client, offline):
    ref = offline.long[1]
    stream = client.completions.create(
        model=client.model,
        prompt=PROMPTS[1],
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)
    texts = [c.choices[0].text for c in chunks[:-1]]
    assert len(texts) > 1  # piece by piece
    assert "".join(texts) == ref.text
    assert chunks[-2].choices[0].finish_reason == ref.finish_reason


def test_chat_matches_offline_greedy_streamed_or_not(client, offline):
    ref = offline.chat
    r = client.chat.completions.create(
        model=client.model, messages=CHAT, max_tokens=16, temperature=0
    )
    assert r.choices[0].message.content == ref.text and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == len(ref.token_ids)
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    stream = client.chat.completions.create(
        model=client.model, messages=CHAT, max_tokens=16, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == ref.finish_reason


def test_stop_string_never_shows(client, llm, offline):
    """Neither its text nor its tokens: logprobs list the tokens whose text starts in the
    answer (the last may run on into the cut), streamed or not."""
    ref = offline.long[0]
    pieces = [llm.tokenizer.decode([t]) for t in ref.token_ids]
    stop = pieces[2] + pieces[3]  # two tokens from the middle of the greedy answer
    expected = ref.text[: ref.text.index(stop)]
    kwargs = dict(model=client.model, prompt=PROMPTS[0], max_tokens=16, temperature=0, stop=[stop])
    choice = client.completions.create(**kwargs, logprobs=1).choices[0]
    assert choice.text == expected and choice.finish_reason == "stop"
    lp = choice.logprobs
    assert "".join(lp.tokens).startswith(expected) and max(lp.text_offset) < len(expected)
    chunks = [c.choices[0] for c in client.completions.create(**kwargs, logprobs=1, stream=True)]
    assert "".join(c.text for c in chunks) == expected
    assert [t for c in chunks if c.logprobs for t in c.logprobs.tokens] == lp.tokens


def test_seeds_reproduce_and_n_choices_use_seed_plus_i(client):
    kwargs = dict(model=client.model, messages=CHAT, max_tokens=8, temperature=1.0)
    one = client.chat.completions.create(**kwargs, seed=1234).choices[0].message.content
    again = client.chat.completions.create(**kwargs, seed=1234).choices[0].message.content
    nxt = client.chat.completions.create(**kwargs, seed=1235).choices[0].message.content
    both = client.chat.completions.create(**kwargs, seed=1234, n=2)
    assert one == again
    assert [c.message.content for c in both.choices] == [one, nxt]
    assert [c.index for c in both.choices] == [0, 1]


def test_batch_of_prompts_with_n(client, llm, offline):
    r = client.completions.create(
        model=client.model,
        prompt=PROMPTS[:2],
        n=2,
        max_tokens=CONCURRENT_TOKENS,
        temperature=0,
        logprobs=TOP,
    )
    refs = offline.completions[:2]
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for choice, ref in zip(r.choices, [refs[0], refs[0], refs[1], refs[1]], strict=True):
        assert_close_to(llm, ref, choice.text, [choice.logprobs])
    # Each prompt counts once, each choice's tokens count.
    assert r.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in refs)
    assert r.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in r.choices)


def test_token_id_prompt_and_echo(client, llm, offline):
    ref = offline.long[0]
    r = client.completions.create(
        model=client.model, prompt=ref.prompt_token_ids, max_tokens=16, temperature=0, echo=True
    )
    assert r.choices[0].text == llm.tokenizer.decode(ref.prompt_token_ids) + ref.text


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_logprobs_scores_the_prompt(client, llm, offline, stream):
    """What evaluation harnesses send for loglikelihoods: echo with logprobs gives every prompt
    token's logprob (null for the first, as OpenAI's API does), then the generated tokens'."""
    ref = offline.echo
    r = client.completions.create(
        model=client.model,
        prompt=PROMPTS[1],
        max_tokens=4,
        temperature=0,
        logprobs=2,
        echo=True,
        stream=stream,
    )
    chunks = list(r) if stream else [r]
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    lps = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    tokens = [t for lp in lps for t in lp.tokens]
    values = [v for lp in lps for v in lp.token_logprobs]
    tops = [t for lp in lps for t in lp.top_logprobs]
    prompt = ref.prompt_token_ids
    assert text == PROMPTS[1] + ref.text and "".join(tokens) == text
    want = [None] + [lp.logprob for lp in ref.prompt_logprobs[1:]]
    want += [lp.logprob for lp in ref.outputs[0].logprobs]
    assert values == want and len(tokens) == len(prompt) + len(ref.token_ids)
    assert tops[0] is None and all(len(t) <= 2 for t in tops[1:])
    assert lps[0].text_offset[: len(prompt)] == [
        len(llm.tokenizer.decode(prompt[:i])) for i in range(len(prompt))
    ]


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_max_tokens_0_scores_the_prompt_alone(client, offline, stream):
    """What lm-eval sends to score a prompt: echo, logprobs and max_tokens 0 give the prompt
    with its tokens' logprobs and no completion, as OpenAI's API does."""
    ref = offline.echo
    r = client.completions.create(
        model=client.model,
        prompt=PROMPTS[1],
        max_tokens=0,
        logprobs=2,
        echo=True,
        stream=stream,
        **({"stream_options": {"include_usage": True}} if stream else {}),
    )
    chunks = list(r) if stream else [r]
    choices = [c.choices[0] for c in chunks if c.choices]
    assert "".join(c.text for c in choices) == PROMPTS[1]
    values = [v for c in choices if c.logprobs for v in c.logprobs.token_logprobs]
    assert values == [None] + [lp.logprob for lp in ref.prompt_logprobs[1:]]
    assert [c.finish_reason for c in choices if c.finish_reason] == ["length"]
    usage = chunks[-1].usage
    assert usage.completion_tokens == 0
    assert usage.prompt_tokens == usage.total_tokens == len(ref.prompt_token_ids)


def test_logprobs_shapes(client, offline):
    ref = offline.long[0]
    r = client.completions.create(
        model=client.model, prompt=PROMPTS[0], max_tokens=16, temperature=0, logprobs=3
    )
    lp = r.choices[0].logprobs
    n = len(ref.token_ids)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    assert "".join(lp.tokens) == ref.text and lp.text_offset[0] == 0
    assert all(len(top) <= 3 and max(top.values()) <= 0 for top in lp.top_logprobs)
    # Greedy: the chosen token is the most likely one.
    assert all(
        x == pytest.approx(max(top.values()))
        for x, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True)
    )
    chat = client.chat.completions.create(
        model=client.model,
        messages=CHAT,
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.bytes == list(t.token.encode()) for t in content)
    assert "".join(t.token for t in content) == chat.choices[0].message.content


def test_concurrent_streams_batch_and_match_offline(base_url, llm, offline):
    async def one(client: openai.AsyncOpenAI, prompt: str) -> tuple[str, list]:
        stream = await client.completions.create(
            model=llm.model_name,
            prompt=prompt,
            max_tokens=CONCURRENT_TOKENS,
            temperature=0,
            logprobs=TOP,
            stream=True,
        )
        chunks = [c.choices[0] async for c in stream]
        return "".join(c.text for c in chunks), [c.logprobs for c in chunks if c.logprobs]

    async def run() -> list[tuple[str, list]]:
        async with openai.AsyncOpenAI(
            base_url=f"{base_url}/v1",
            api_key="unused",
            max_retries=0,
            http_client=openai.DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=100)),
        ) as client:
            return await asyncio.gather(*(one(client, p) for p in PROMPTS))

    results = asyncio.run(run())
    for ref, (text, logprobs) in zip(offline.completions, results, strict=True):
        assert_close_to(llm, ref, text, logprobs)
    assert metrics(base_url)["tinyllm_num_requests_running_peak"] > 1


def test_counters_move_by_a_requests_tokens(client, base_url):
    before = metrics(base_url)
    r = client.completions.create(
        model=client.model,
        prompt=PROMPTS[3],
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    after = metrics(base_url)
    assert r.usage.completion_tokens == 5
    gen, prompt = "tinyllm_generation_tokens_total", "tinyllm_prompt_tokens_total"
    assert after[gen] - before[gen] == 5
    assert after[prompt] - before[prompt] == r.usage.prompt_tokens
    ok = "tinyllm_request_success_total{finish_reason=length}"
    assert after[ok] - before.get(ok, 0) == 1
    assert (
        after["tinyllm_e2e_request_latency_seconds_count"]
        > before["tinyllm_e2e_request_latency_seconds_count"]
    )
    assert after["tinyllm_kv_blocks_used"] == 0 and after["tinyllm_num_requests_running"] == 0


def test_prefix_cache_hits_show_in_usage_and_metrics_and_reset_forgets_them(client, base_url):
    prompt = "You are a helpful assistant who answers questions about the sea. " * 4
    ask = dict(model=client.model, prompt=prompt, max_tokens=2, temperature=0)
    first = client.completions.create(**ask)
    before = metrics(base_url)
    again = client.completions.create(**ask)
    after = metrics(base_url)
    n = again.usage.prompt_tokens
    hit = (n - 1) // 16 * 16  # whole blocks, the last token computed (KVCacheManager.match)
    assert hit > 0 and again.usage.prompt_tokens_details.cached_tokens == hit
    assert again.choices[0].text == first.choices[0].text
    queries, hits = "tinyllm_prefix_cache_queries_total", "tinyllm_prefix_cache_hits_total"
    assert after[queries] - before[queries] == n
    assert after[hits] - before[hits] == hit
    prompt_run = "tinyllm_prompt_tokens_total"
    assert after[prompt_run] - before[prompt_run] == n - hit  # only the uncached ones ran
    reset = httpx.post(f"{base_url}/reset_prefix_cache")
    assert reset.status_code == 200 and reset.json()["num_blocks_forgotten"] >= hit // 16
    cold = client.completions.create(**ask)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0


def _wait_idle(base_url: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while metrics(base_url)["tinyllm_kv_blocks_used"] != 0:
        assert time.monotonic() < deadline, "KV blocks were not freed after the client left"
        time.sleep(0.05)


def test_disconnect_mid_stream_frees_kv_blocks(base_url, llm):
    body = {
        "model": llm.model_name,
        "prompt": PROMPTS[5],
        "max_tokens": 900,
        "stream": True,
        "ignore_eos": True,
    }
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", f"{base_url}/v1/completions", json=body) as r,
    ):
        events = (line for line in r.iter_lines() if line.startswith("data: {"))
        next(events), next(events)
        assert metrics(base_url)["tinyllm_kv_blocks_used"] > 0
    _wait_idle(base_url)
    assert metrics(base_url)["tinyllm_request_success_total{finish_reason=abort}"] >= 1


def test_disconnect_while_waiting_frees_kv_blocks(base_url, llm):
    body = {"model": llm.model_name, "prompt": PROMPTS[6], "max_tokens": 900, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base_url}/v1/completions", json=body, timeout=1.5)
    _wait_idle(base_url)


def test_utility_endpoints(base_url, llm):
    models = httpx.get(f"{base_url}/v1/models").json()["data"]
    assert [(m["id"], m["max_model_len"]) for m in models] == [
        (llm.model_name, llm.engine.max_model_len)
    ]
    assert httpx.get(f"{base_url}/health").status_code == 200
    assert httpx.get(f"{base_url}/version").json()["version"]
    tok = httpx.post(f"{base_url}/tokenize", json={"prompt": PROMPTS[0]}).json()
    assert tok["tokens"] == llm.tokenizer.encode(PROMPTS[0]) and tok["count"] == len(tok["tokens"])
    assert tok["max_model_len"] == llm.engine.max_model_len
    text = httpx.post(f"{base_url}/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"]
    assert text == PROMPTS[0]
    chat = httpx.post(f"{base_url}/tokenize", json={"messages": CHAT}).json()
    rendered = llm.tokenizer.apply_chat_template(CHAT)
    assert chat["tokens"] == llm.tokenizer.encode(rendered, add_special_tokens=False)


def with_engine(llm, engine) -> SimpleNamespace:
    """`llm` as the server reads it, with `engine` in place of its own."""
    return SimpleNamespace(
        engine=engine,
        tokenizer=llm.tokenizer,
        model_name=llm.model_name,
        get_default_sampling_params=llm.get_default_sampling_params,
        default_sampling=llm.default_sampling,
        reasoning=llm.reasoning,
        reasoning_budget=llm.reasoning_budget,
        tool_format=llm.tool_format,
    )


class _FailingEngine:
    """The real engine's shape, but step() raises: what the server does when its engine dies."""

    def __init__(self, engine):
        self._engine, self._pending = engine, False
        self._stats = engine.stats()  # now, while no other thread drives the engine

    def __getattr__(self, name):  # max_model_len, vocab_size, request_validator: read-only
        return getattr(self._engine, name)

    outputs = LLMEngine.outputs  # runs this engine's has_unfinished() and step()

    def add_request(self, prompt, params, request_id=None, prompt_token_ids=None):
        self._pending = True
        return request_id

    def has_unfinished(self) -> bool:
        return self._pending

    def step(self):
        raise RuntimeError("simulated engine failure")

    def stats(self) -> EngineStats:
        return self._stats


def test_engine_death_fails_requests_and_health(llm):
    broken = with_engine(llm, _FailingEngine(llm.engine))
    with serving(create_app(broken)) as url:
        assert httpx.get(f"{url}/health").status_code == 200
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=10)
        with pytest.raises(openai.APIError, match="engine"):
            list(client.completions.create(model=llm.model_name, prompt="Hi", stream=True))
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and "simulated" in health.json()["error"]["message"]
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(model=llm.model_name, prompt="Hi")
        assert e.value.status_code == 503


class _StumblingEngine:
    """The real engine, but its next step() raises, as a fault outside any one request's work
    would (the engine itself ends a request whose own work fails)."""

    def __init__(self, engine):
        self._engine, self.stumble = engine, False

    def __getattr__(self, name):
        return getattr(self._engine, name)

    outputs = LLMEngine.outputs  # runs this engine's step()

    def step(self):
        if self.stumble:
            self.stumble = False
            raise RuntimeError("simulated fault in a step")
        return self._engine.step()


def test_a_step_that_raises_fails_its_requests_and_the_server_goes_on(llm, offline):
    engine = _StumblingEngine(llm.engine)
    wrapped = with_engine(llm, engine)
    with serving(create_app(wrapped)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
        engine.stumble = True
        with pytest.raises(openai.InternalServerError, match="simulated fault"):
            client.completions.create(model=llm.model_name, prompt=PROMPTS[0], max_tokens=4)
        assert httpx.get(f"{url}/health").status_code == 200
        r = client.completions.create(
            model=llm.model_name, prompt=PROMPTS[0], max_tokens=16, temperature=0
        )
        assert r.choices[0].text == offline.long[0].text
    assert llm.engine.kv.pool.num_used == 0 and not llm.engine.requests
