"""The default configuration, what `LLM()` gives users (int4 weights on tinyllm's kernels, the
CPU attention backend, chunked prefill), and the other weight formats, through the engine's
important paths: prompts longer than a step's budget, budgets of 1, 2 and 16 tokens,
preemption under a tiny pool, prompts at the edge of max_model_len, greedy closeness to the
fp32 reference, and the default's promise that a request's logprobs are the same bits whatever
it is batched with, however its prompt is chunked and on however many threads."""

import random

import pytest
import torch

from tests.conftest import FORMATS
from tests.engine_runs import engine_on, run_all
from tests.greedy import assert_greedy_close, top_dicts
from tinyllm.engine.outputs import RequestOutput
from tinyllm.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=5)


def _random_prompts(n: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(rng.choice(lengths))] for _ in range(n)]


def _assert_close(ref: RequestOutput, out: RequestOutput, label: str, near_tie=0.05) -> None:
    assert_greedy_close(
        ref.token_ids,
        top_dicts(ref.outputs[0].logprobs),
        out.token_ids,
        top_dicts(out.outputs[0].logprobs),
        label,
        near_tie,
    )


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_prompt_longer_than_the_budget_runs_in_every_format(llm_by_format, fmt):
    """513 tokens at the default budget of 512: a step that only runs a prompt chunk has no row
    to sample (this once killed the int4 and int8 formats with SIGFPE)."""
    llm = llm_by_format(fmt)
    prompt = _random_prompts(1, [513])
    chunked = run_all(engine_on(llm), prompt, GREEDY)[0]
    whole = run_all(engine_on(llm, max_num_batched_tokens=1024), prompt, GREEDY)[0]
    assert chunked.finish_reason == "length" and len(chunked.token_ids) == 6
    # int8 runs bf16 activations: on random ids its logits tie often, so vLLM's bf16 rule.
    _assert_close(whole, chunked, f"{fmt} chunked at 512", None if fmt == "int8" else 0.05)
    assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].token_ids == chunked.token_ids


@pytest.mark.parametrize("budget", [1, 2, 16])
def test_tiny_budgets_give_the_same_bits(default_config_llm, budget):
    """Prompts chunked a token or two at a time, decodes sharing the budget with them: every
    request's tokens and logprobs equal, bit for bit, those of a budget that never chunks."""
    prompts = _random_prompts(3, [5, 23, 40], seed=budget)
    ref = run_all(engine_on(default_config_llm), prompts, GREEDY)
    engine = engine_on(default_config_llm, max_num_batched_tokens=budget)
    out = run_all(engine, prompts, GREEDY)
    for r, o in zip(ref, out, strict=True):
        assert o.token_ids == r.token_ids
        assert o.outputs[0].logprobs == r.outputs[0].logprobs


@pytest.mark.parametrize("budget", [512, 32])
def test_preemption_on_the_default_config_recomputes_the_same_bits(default_config_llm, budget):
    """12 blocks of 16 tokens, six 40-token prompts growing to 88: the newest requests are
    preempted again and again (mid-prefill too, at budget 32) and recomputed, generated tokens
    as part of a prompt chunk; every output equals the request run alone, bit for bit, and every
    block comes back."""
    prompts = _random_prompts(6, [40], seed=3)
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True, logprobs=2)
    alone = [run_all(engine_on(default_config_llm), [p], params)[0] for p in prompts]
    engine = engine_on(
        default_config_llm, num_blocks=12, max_num_seqs=8, max_num_batched_tokens=budget
    )
    out = run_all(engine, prompts, params)
    assert engine.stats().num_preemptions > 0 and engine.kv.pool.peak_used == 12
    for a, o in zip(alone, out, strict=True):
        assert o.token_ids == a.token_ids
        assert o.outputs[0].logprobs == a.outputs[0].logprobs


def test_a_prompt_at_the_edge_of_max_model_len(llm_by_format, default_config_llm):
    """2040 tokens of a 2048 context (chunked in four): it generates until the context is full,
    close to the fp32 reference; one token more is refused before it runs."""
    prompt = _random_prompts(1, [2040], seed=5)
    params = SamplingParams(max_tokens=None, temperature=0, ignore_eos=True, logprobs=5)
    out = run_all(engine_on(default_config_llm), prompt, params)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 8
    ref = run_all(engine_on(llm_by_format("fp32")), prompt, params)[0]
    _assert_close(ref, out, "int4 at 2040 tokens", near_tie=None)
    engine = engine_on(default_config_llm)
    with pytest.raises(ValueError, match="prompt is 2048 tokens, but this model's context is 2048"):
        engine.add_request(None, params, prompt_token_ids=prompt[0] + [7] * 8)
    assert not engine.has_unfinished()


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_greedy_close_to_the_fp32_reference(llm_by_format, fmt):
    """The quantized kernels against the same weights dense (the GGUF's Q4_1 values in fp32),
    batched with chunking: vLLM's closeness rule for other weights (each side's token in the
    other's top 5 at the first difference)."""
    tok = llm_by_format("fp32").tokenizer
    questions = ["What is the capital of France?", "Write a haiku about the sea."]
    chats = [tok.encode_chat([{"role": "user", "content": q}])[1] for q in questions]
    prompts = chats + _random_prompts(2, [300], seed=9)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=5)
    ref = run_all(engine_on(llm_by_format("fp32")), prompts, params)
    out = run_all(engine_on(llm_by_format(fmt), max_num_batched_tokens=64), prompts, params)
    for i, (r, o) in enumerate(zip(ref, out, strict=True)):
        _assert_close(r, o, f"{fmt} request {i}", near_tie=None)


def test_a_requests_bits_do_not_depend_on_batch_budget_or_threads(default_config_llm):
    """The promise docs/DESIGN.md, "The same request gives the same bits", makes for the default
    configuration: a greedy request's
    logprobs are bit-identical alone or among 32 other requests, at any chunked-prefill budget,
    on one thread or two."""
    tok = default_config_llm.tokenizer
    prompt = tok.encode_chat([{"role": "user", "content": "Why is the sky blue?"}])[1]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=5)
    others = _random_prompts(32, [8, 60, 200], seed=11)
    other_params = [SamplingParams(max_tokens=random.Random(i).randint(4, 24)) for i in range(32)]
    threads = torch.get_num_threads()
    runs = {}
    try:
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            for budget in (512, 48, 7):
                alone = run_all(
                    engine_on(default_config_llm, max_num_batched_tokens=budget), [prompt], params
                )
                batch = run_all(
                    engine_on(default_config_llm, max_num_batched_tokens=budget),
                    others[:16] + [prompt] + others[16:],
                    other_params[:16] + [params] + other_params[16:],
                )
                runs[f"alone, budget {budget}, {n_threads} thread(s)"] = alone[0]
                runs[f"batched, budget {budget}, {n_threads} thread(s)"] = batch[16]
    finally:
        torch.set_num_threads(threads)
    first = next(iter(runs.values()))
    for label, out in runs.items():
        assert out.token_ids == first.token_ids, label
        assert out.outputs[0].logprobs == first.outputs[0].logprobs, label
