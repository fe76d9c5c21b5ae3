"""Property tests of the engine's bookkeeping: random workloads, random aborts, tiny pools.

A tiny random model keeps each example fast; what is checked is accounting, not text: no block
owned twice, none leaked, every request ends, and everything is given back."""

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import TINY_MAX_LEN, TINY_VOCAB
from tinyllm.engine.config import EngineConfig
from tinyllm.engine.engine import LLMEngine
from tinyllm.engine.sampling_params import SamplingParams
from tinyllm.engine.spec_decode.ngram_proposer import Match

VOCAB, MAX_LEN = TINY_VOCAB, TINY_MAX_LEN


def _check(engine: LLMEngine) -> None:
    pool, sched = engine.kv.pool, engine.scheduler
    owned = [b for r in sched.running for b in r.block_ids]
    assert len(owned) == len(set(owned)), "a block is owned by two live requests"
    assert len(owned) == pool.num_used, "a block leaked"
    assert all(pool.ref_cnt[b] == 1 for b in owned)
    assert not any(r.block_ids for r in sched.waiting), "a waiting request holds blocks"
    for r in sched.running:  # every computed token has a block
        assert len(r.block_ids) * engine.kv.block_size >= r.num_computed_tokens
    assert set(engine.requests) == {r.request_id for r in [*sched.running, *sched.waiting]}


request = st.tuples(
    st.integers(1, 40),  # prompt length
    st.integers(1, 20),  # max_tokens
    st.integers(0, 6),  # arrival step
    st.one_of(st.none(), st.integers(0, 30)),  # abort at this step (None: never)
    st.booleans(),  # ignore_eos
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    requests=st.lists(request, min_size=1, max_size=10),
    kv_cache=st.sampled_from(["paged", "slot"]),
    num_blocks=st.integers(1, 12),
    block_size=st.sampled_from([1, 2, 4, 8]),
    max_num_seqs=st.integers(1, 4),
    budget=st.integers(1, 64),
    temperature=st.sampled_from([0.0, 1.0]),
    speculate=st.one_of(st.none(), st.integers(0, 2**16)),
)
def test_random_workload_accounts_for_everything(
    tiny, requests, kv_cache, num_blocks, block_size, max_num_seqs, budget, temperature, speculate
):
    """`speculate`: random draft tokens, of which a random number is accepted (the seed)."""
    model, tok = tiny
    engine = LLMEngine(
        model,
        tok,
        EngineConfig(
            kv_cache=kv_cache,
            num_blocks=num_blocks,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            kv_cache_memory=MAX_LEN * 64 * max_num_seqs,
            seed=1,
            speculative_config=None if speculate is None else {"max_batch": 4},
        ),
    )
    if speculate is not None:
        _random_speculation(engine, random.Random(speculate))
    finished: dict[str, object] = {}
    for step in range(400):
        for i, (n, max_tokens, arrive, _, ignore_eos) in enumerate(requests):
            if arrive == step:
                params = SamplingParams(
                    max_tokens=max_tokens, temperature=temperature, ignore_eos=ignore_eos
                )
                ids = [(i * 7 + j) % VOCAB for j in range(n)]
                if n >= engine.max_model_len:  # the context, cut to what the pool holds
                    with pytest.raises(ValueError, match=f"prompt is {n} tokens"):
                        engine.add_request(None, params, request_id=str(i), prompt_token_ids=ids)
                    finished[str(i)] = "refused"
                    continue
                engine.add_request(None, params, request_id=str(i), prompt_token_ids=ids)
        for i, (*_, abort_at, _) in enumerate(requests):
            if abort_at == step and str(i) not in finished:
                out = engine.abort(str(i))
                if out is not None:
                    finished[str(i)] = out
        for out in engine.step():
            if out.finished:
                assert out.request_id not in finished, "a request finished twice"
                finished[out.request_id] = out
        _check(engine)
        if step > 6 and not engine.has_unfinished():
            break
    assert not engine.has_unfinished(), "the engine stopped making progress"
    assert sorted(finished, key=int) == [str(i) for i in range(len(requests))]
    assert engine.kv.pool.num_used == 0 and not any(engine.kv.pool.ref_cnt)
    for i, (n, max_tokens, *_, ignore_eos) in enumerate(requests):
        out = finished[str(i)]
        if out == "refused":
            assert n >= engine.max_model_len
        elif out.finish_reason == "length":  # a request never outgrows the pool: no "error"
            assert (
                len(out.token_ids) == max_tokens or n + len(out.token_ids) == engine.max_model_len
            )
        elif out.finish_reason == "stop":
            assert out.token_ids[-1] == 1 and not ignore_eos
        else:
            assert out.finish_reason == "abort"


def _random_speculation(engine: LLMEngine, rng: random.Random) -> None:
    """Drafts from random places in the context and of random lengths (up to what fits), of
    which the sampler keeps a random number, then adds a random token: every acceptance length
    the engine must roll back."""

    def match(token_ids, index=None):
        if len(token_ids) < 2 or rng.random() < 0.2:
            return None
        return Match(rng.randrange(len(token_ids) - 1), rng.randint(1, 3))

    sampler = engine.runner.sampler
    verify = sampler.verify

    def accept_some(logits, requests, drafts, *args):
        tokens, logprobs = verify(logits, requests, drafts, *args)
        for r, draft in enumerate(drafts):
            if draft:
                tokens[r] = draft[: rng.randint(0, len(draft))] + [rng.randrange(VOCAB)]
                logprobs[r] = [None] * len(tokens[r])
        return tokens, logprobs

    engine.speculator.proposer.match = match
    sampler.verify = accept_some


@pytest.mark.parametrize(
    ("kv_cache", "what"), [("slot", "one slot of 48 tokens"), ("paged", "one block")]
)
def test_a_budget_too_small_for_one_sequence_is_refused(tiny, kv_cache, what):
    model, tok = tiny
    with pytest.raises(ValueError, match=f"kv_cache_memory=100 bytes cannot hold {what}"):
        LLMEngine(model, tok, EngineConfig(kv_cache=kv_cache, kv_cache_memory=100, block_size=4))
