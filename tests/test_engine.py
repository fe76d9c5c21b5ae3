"""The continuous-batching engine on the default model: same greedy tokens as running each
prompt alone, with the paged and the slot cache, all at once or arriving over time, with
prompts prefilled in chunks alongside decodes, and through preemption."""

import random

import pytest

from tests.greedy import assert_greedy_close, top_dicts
from tinyllm.engine.config import EngineConfig
from tinyllm.engine.engine import LLMEngine
from tinyllm.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

N_REQUESTS = 16


@pytest.fixture(scope="module")
def workload(default_llm):
    """16 requests: chat prompts and random token ids, 3 to ~300 tokens, 4 to 24 new tokens."""
    tok = default_llm.tokenizer
    rng = random.Random(7)
    questions = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "List three prime numbers.",
        "Why is the sky blue?",
    ]
    prompts = []
    for i in range(N_REQUESTS):
        if i % 2:
            q = questions[i // 2 % len(questions)]
            text = tok.apply_chat_template([{"role": "user", "content": q}])
            prompts.append(tok.encode(text, add_special_tokens=False))
        else:
            prompts.append([rng.randrange(100, 49000) for _ in range(rng.choice([3, 40, 300]))])
    params = [
        SamplingParams(max_tokens=rng.randint(4, 24), temperature=0, ignore_eos=True, logprobs=5)
        for _ in prompts
    ]
    return prompts, params


def _engine(llm, **kw) -> LLMEngine:
    kw.setdefault("num_blocks", 512)  # 8192 tokens: room for the whole workload, 368 MiB
    return LLMEngine(llm.engine.model, llm.tokenizer, EngineConfig(**kw))


def _run(engine: LLMEngine, prompts, params, per_step: int | None = None) -> dict:
    """Submit everything (or `per_step` new requests per step); returns id -> final output.
    Records on the engine the most requests running at once and whether any step mixed
    decode tokens with prefill chunks."""
    pending = list(enumerate(zip(prompts, params, strict=True)))
    done, max_running = {}, 0
    engine.mixed_steps = engine.chunked_prompts = 0
    schedule = engine.scheduler.schedule

    def spy():
        out = schedule()
        prompt_left = {
            req_id: engine.requests[req_id].num_prompt_tokens - start
            for req_id, start in out.num_computed_tokens.items()
        }
        kinds = {left > 0 for left in prompt_left.values()}
        engine.mixed_steps += kinds == {True, False}
        engine.chunked_prompts += sum(
            0 < left < engine.requests[req_id].num_prompt_tokens
            for req_id, left in prompt_left.items()
        )
        return out

    engine.scheduler.schedule = spy
    while pending or engine.has_unfinished():
        take = len(pending) if per_step is None else per_step
        for i, (p, sp) in pending[:take]:
            engine.add_request(None, sp, request_id=str(i), prompt_token_ids=p)
        pending = pending[take:]
        for out in engine.step():
            if out.finished:
                done[int(out.request_id)] = out
        max_running = max(max_running, engine.stats().num_running)
    engine.max_running = max_running
    return done


@pytest.fixture(scope="module")
def alone(default_llm, workload):
    """The reference: each prompt run by itself."""
    prompts, params = workload
    outs = {}
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        outs[i] = _run(_engine(default_llm, max_num_seqs=1), [p], [sp])[0]
    return outs


def _assert_same(alone, done, label):
    assert sorted(done) == list(range(N_REQUESTS))
    for i, ref in alone.items():
        out = done[i]
        assert out.finish_reason == "length" and len(out.token_ids) == len(ref.token_ids)
        assert_greedy_close(
            ref.token_ids,
            top_dicts(ref.outputs[0].logprobs),
            out.token_ids,
            top_dicts(out.outputs[0].logprobs),
            f"{label} request {i}",
        )


@pytest.mark.parametrize(
    ("kv_cache", "budget"), [("paged", 512), ("paged", 32), ("paged", 24), ("slot", 512)]
)
@pytest.mark.parametrize("per_step", [None, 3])
def test_batched_equals_alone(default_llm, workload, alone, kv_cache, budget, per_step):
    """Budget 32: 300-token prompts take ten chunks, each chunk ending on a block boundary;
    budget 24: chunks end inside blocks. Either way steps mix decodes and prefill chunks."""
    engine = _engine(
        default_llm,
        kv_cache=kv_cache,
        max_num_seqs=16,
        max_model_len=1024,
        max_num_batched_tokens=budget,
    )
    done = _run(engine, *workload, per_step=per_step)
    _assert_same(alone, done, f"{kv_cache} budget={budget} per_step={per_step}")
    assert engine.max_running > 1
    assert engine.stats().kv_blocks_used == 0
    if budget < 300:
        assert engine.chunked_prompts > 0 and engine.mixed_steps > 0


@pytest.mark.parametrize(("budget", "caching"), [(512, True), (32, True), (512, False)])
def test_preemption_reproduces_outputs(default_llm, workload, budget, caching):
    """12 blocks of 16 tokens: four 40-token prompts fit at first, and each grows to 88 tokens,
    so decode runs out of blocks again and again and the newest requests are recomputed. With
    a budget of 32 tokens prompts are chunked, and some are preempted mid-prefill. With prefix
    caching a recomputed request first finds what is left of its own blocks."""
    prompts = [p[:40] for p in workload[0] if len(p) >= 40][:6]
    params = [SamplingParams(max_tokens=48, temperature=0, ignore_eos=True, logprobs=5)] * 6
    ref = {
        i: _run(_engine(default_llm, max_num_seqs=1), [p], [params[0]])[0]
        for i, p in enumerate(prompts)
    }
    engine = _engine(
        default_llm,
        num_blocks=12,
        block_size=16,
        max_num_seqs=8,
        max_num_batched_tokens=budget,
        enable_prefix_caching=caching,
    )
    victims, lost = [], []
    preempt = engine.scheduler._preempt

    def spy(request):
        victims.append("prefill" if request.num_computed_tokens < 40 else "decode")
        lost.append(request.num_computed_tokens)
        preempt(request)

    engine.scheduler._preempt = spy
    done = _run(engine, prompts, params)
    stats = engine.stats()
    assert stats.num_preemptions == len(victims) > 0
    assert "decode" in victims and ("prefill" in victims or budget > 40)
    # Every token lost is computed again, once, or found in the cache at readmission (hits
    # beyond those of first admissions).
    rehits = stats.prefix_cache_hits - sum(out.num_cached_tokens for out in done.values())
    assert stats.recomputed_tokens + rehits == sum(lost)
    assert (rehits > 0) is caching
    assert engine.kv.pool.num_used == 0 and engine.kv.pool.peak_used == 12
    for i, r in ref.items():
        assert len(done[i].token_ids) == 48
        assert_greedy_close(
            r.token_ids,
            top_dicts(r.outputs[0].logprobs),
            done[i].token_ids,
            top_dicts(done[i].outputs[0].logprobs),
            f"preempted request {i}",
        )


def test_a_pool_smaller_than_the_context_refuses_what_it_can_never_hold(default_llm):
    """64 tokens of pool cut the context to 64: a 100-token prompt is refused when added (with
    nothing queued), the others run to their max_tokens or to the pool's end."""
    engine = _engine(default_llm, num_blocks=4, block_size=16)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    with pytest.raises(ValueError, match="prompt is 100 tokens, but this model's context is 64"):
        engine.add_request(None, params, prompt_token_ids=[200] * 100)
    assert not engine.has_unfinished()
    done = _run(engine, [[300] * 10, [400] * 30], [params] * 2)
    assert [done[i].finish_reason for i in (0, 1)] == ["length", "length"]
    assert len(done[0].token_ids) == 40 and len(done[1].token_ids) == 64 - 30
    assert engine.kv.pool.num_used == 0


def test_prompt_longer_than_context_is_refused(default_llm):
    engine = _engine(default_llm, max_model_len=64)
    with pytest.raises(ValueError, match="prompt is 64 tokens, but this model's context is 64"):
        engine.add_request(None, SamplingParams(), prompt_token_ids=[5] * 64)
    assert not engine.has_unfinished()


def test_seeded_sampling_ignores_batch(default_llm, workload):
    prompts, _ = workload
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234)
    alone = _run(_engine(default_llm), [prompts[1]], [seeded])[0]
    busy = [SamplingParams(max_tokens=16, temperature=0.8) for _ in prompts]
    busy[5] = seeded
    done = _run(
        _engine(default_llm), [prompts[1] if i == 5 else p for i, p in enumerate(prompts)], busy
    )
    assert done[5].token_ids == alone.token_ids
    other = _run(
        _engine(default_llm),
        [prompts[1]],
        [SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=99)],
    )[0]
    assert other.token_ids != alone.token_ids


def test_abort_frees_everything(default_llm):
    engine = _engine(default_llm, num_blocks=64)
    params = SamplingParams(max_tokens=50, temperature=0)
    for i in range(4):
        engine.add_request(None, params, request_id=f"r{i}", prompt_token_ids=[100 + i] * 30)
    engine.step()
    assert engine.kv.pool.num_used > 0
    out = engine.abort("r1")
    assert out.finish_reason == "abort" and out.finished
    for i in (0, 2, 3):
        engine.abort(f"r{i}")
    assert engine.kv.pool.num_used == 0 and not engine.has_unfinished()
    assert engine.abort("r1") is None
