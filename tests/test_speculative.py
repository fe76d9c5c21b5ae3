"""Speculative decoding on the default configuration (int4, the CPU attention kernel, chunked
prefill): greedy tokens and their logprobs are the same bits with it on as off, on prompts
whose answers copy their context (drafts accepted) and on random ones (drafts rejected), in
batches, chunked, under preemption, with stop strings and max_tokens inside an accepted run;
and the server streams the same text and counts the drafts in /metrics."""

import copy
import inspect
import json
import random
import textwrap

import httpx
import pytest

from tests.engine_runs import engine_on, run_all
from tests.http_server import openai_client
from tests.test_server import metrics
from tinyllm.engine.outputs import RequestOutput
from tinyllm.engine.sampling_params import SamplingParams
from tinyllm.engine.structured_output.params import StructuredOutputsParams

pytestmark = pytest.mark.slow

SPEC = {"method": "ngram", "num_speculative_tokens": 5, "max_batch": 8}
GREEDY = SamplingParams(max_tokens=40, temperature=0, logprobs=3)


def _grounded(llm) -> list[list[int]]:
    """Chat prompts whose answers copy their context: code from the standard library."""
    asks = [
        ("Repeat this function exactly:", inspect.getsource(textwrap.dedent)),
        ("Copy this code, adding a comment line at the top:", inspect.getsource(json.dump)),
    ]
    chats = [[{"role": "user", "content": f"{a}\n{c}"}] for a, c in asks]
    return [llm.tokenizer.encode_chat(chat)[1] for chat in chats]


def _random(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(length)] for _ in range(n)]


def _assert_same(ref: list[RequestOutput], out: list[RequestOutput]) -> None:
    for r, o in zip(ref, out, strict=True):
        assert o.token_ids == r.token_ids
        assert o.outputs[0].logprobs == r.outputs[0].logprobs  # the same bits
        assert o.outputs[0].text == r.outputs[0].text
        assert o.finish_reason == r.finish_reason


@pytest.mark.parametrize(
    "setting",
    [{}, {"max_num_batched_tokens": 24}, {"num_blocks": 60, "max_num_batched_tokens": 128}],
    ids=["default", "chunked", "preempted"],
)
def test_greedy_is_the_same_bits_with_speculation(default_config_llm, setting):
    """Two copying prompts (about 260 and 700 tokens: chunked at the default budget of 512)
    and two random ones, together. "chunked": a budget of 24 tokens cuts prompts and drafts
    alike; "preempted": 60 blocks for four requests that grow to about 1300 tokens."""
    prompts = _grounded(default_config_llm) + _random(2, 60, seed=1)
    ref = run_all(engine_on(default_config_llm), prompts, GREEDY)
    engine = engine_on(default_config_llm, speculative_config=SPEC, **setting)
    out = run_all(engine, prompts, GREEDY)
    _assert_same(ref, out)
    spec = engine.stats().spec_decode
    assert spec.num_accepted_tokens >= 20, spec  # it did speculate, and drafts were accepted
    assert spec.num_draft_tokens > spec.num_accepted_tokens  # and some were rejected
    if "num_blocks" in setting:
        assert engine.stats().num_preemptions > 0


def test_stop_strings_and_max_tokens_inside_an_acceptedrun_all(default_config_llm):
    """Requests that end at every few tokens of a copying answer, by a stop string or a stop
    token taken from the answer, or by max_tokens: each ends where it ends without speculation,
    though the step that ends it accepted drafts past that point (checked: some runs are cut).
    (Drafts never go past max_tokens: the proposer is asked for no more than fit.)"""
    prompt = _grounded(default_config_llm)[0]
    full = run_all(engine_on(default_config_llm), [prompt], GREEDY)[0]
    words, ids = full.outputs[0].text.split(), full.token_ids

    def ending(**kw) -> SamplingParams:
        return SamplingParams(**{"max_tokens": 40, "temperature": 0, "logprobs": 1} | kw)

    params = [
        *(ending(max_tokens=m) for m in range(5, 40, 8)),
        *(ending(stop=[w]) for w in words[3:30:5]),
        *(ending(stop_token_ids=[t]) for t in ids[4:36:6]),
    ]
    prompts = [prompt] * len(params)
    ref = run_all(engine_on(default_config_llm), prompts, params)
    engine = engine_on(
        default_config_llm,
        speculative_config=SPEC | {"max_batch": len(params)},
        enable_prefix_caching=False,
    )
    returned: dict[str, int] = {}
    execute = engine.runner.execute_model

    def counting(scheduled):
        result = execute(scheduled)
        for req_id, tokens in zip(result.req_ids, result.sampled_token_ids, strict=True):
            returned[req_id] = returned.get(req_id, 0) + len(tokens)
        return result

    engine.runner.execute_model = counting
    out = run_all(engine, prompts, params)
    _assert_same(ref, out)
    cut = [o for o in out if returned[o.request_id] > len(o.token_ids)]
    stops = [o.outputs[0].stop_reason for o in cut]
    assert any(isinstance(s, str) for s in stops), "no stop string fell inside a run"
    assert any(isinstance(s, int) for s in stops), "no stop token fell inside a run"


def test_constrained_and_penalized_requests_run_beside_speculated_ones(default_config_llm):
    """A JSON-constrained request and a penalized one are not speculated (spec_decode/speculator.py)
    but share the steps of one that is: all three are what they are without speculation."""
    prompts = _grounded(default_config_llm)[:1] * 3
    params = [
        GREEDY,
        SamplingParams(
            max_tokens=40,
            temperature=0,
            structured_outputs=StructuredOutputsParams(json_object=True),
        ),
        SamplingParams(max_tokens=40, temperature=0, repetition_penalty=1.3),
    ]
    ref = run_all(engine_on(default_config_llm), prompts, params)
    engine = engine_on(default_config_llm, speculative_config=SPEC)
    out = run_all(engine, prompts, params)
    for r, o in zip(ref, out, strict=True):
        assert o.token_ids == r.token_ids
    assert engine.stats().spec_decode.num_accepted_tokens > 0


def test_sampled_requests_with_a_seed_repeat(default_config_llm):
    """Sampling with speculation: a seed fixes the output (each request's own generator makes
    every acceptance draw), and drafts are accepted at temperature 0.3."""
    prompts = _grounded(default_config_llm)[:1]
    params = SamplingParams(max_tokens=40, temperature=0.3, seed=11)
    outs = []
    for _ in range(2):
        engine = engine_on(default_config_llm, speculative_config=SPEC)
        outs.append(run_all(engine, prompts, params)[0].token_ids)
        assert engine.stats().spec_decode.num_accepted_tokens > 0
    assert outs[0] == outs[1]


def test_server_streams_the_same_text_and_counts_drafts(default_config_llm):
    ask = "Repeat this function exactly:\n" + inspect.getsource(textwrap.dedent)
    messages = [{"role": "user", "content": ask}]

    def stream(client) -> str:
        chunks = client.chat.completions.create(
            model=client.model, messages=messages, max_tokens=40, temperature=0, stream=True
        )
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    with openai_client(default_config_llm) as client:
        plain = stream(client)
    # What LLM(speculative_config=...) builds, on the weights already loaded.
    spec = copy.copy(default_config_llm)
    spec.engine = engine_on(default_config_llm, speculative_config=SPEC)
    with openai_client(spec) as client:
        assert stream(client) == plain
        url = str(client.base_url).removesuffix("/v1/")
        m = metrics(url)
        assert m["tinyllm_spec_decode_num_accepted_tokens_total"] > 0
        drafts = m["tinyllm_spec_decode_num_drafts_total"]
        assert m["tinyllm_spec_decode_num_draft_tokens_total"] >= drafts > 0
        assert httpx.get(f"{url}/health").status_code == 200
