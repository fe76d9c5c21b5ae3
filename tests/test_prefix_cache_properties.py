"""Property test of prefix caching in the engine: random request streams that share prefixes,
random aborts, tiny pools (so blocks are evicted and requests preempted).

Checked at every step: each block's reference count is the number of live requests holding
it (so never below zero), a free block is held by no one and sits in exactly one free list,
every block in the eviction queue is findable by its key; at every eviction, that the evicted
block is held by no one; at the end, every reference returned, and a sample of cached blocks
holding the K/V a fresh prefill of their tokens computes."""

from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import TINY_MAX_LEN, TINY_VOCAB
from tinyllm.engine.config import EngineConfig
from tinyllm.engine.engine import LLMEngine
from tinyllm.engine.sampling_params import SamplingParams
from tinyllm.engine.sched.block_pool import block_key
from tinyllm.engine.sched.kv_cache_manager import KVCacheManager
from tinyllm.engine.sched.request import Request
from tinyllm.engine.sched.scheduler import step_message
from tinyllm.engine.worker.model_runner import ModelRunner
from tinyllm.model.attention import get_backend
from tinyllm.model.config import ModelConfig
from tinyllm.model.llama import Transformer


@pytest.fixture(scope="module")
def tiny2(tiny):
    """The tiny model with two layers: the second layer's K/V depend on the whole prefix, so a
    block holding another prefix's K/V shows."""
    torch.manual_seed(1)
    cfg = ModelConfig("llama", TINY_VOCAB, 16, 32, 2, 2, 1, 8, TINY_MAX_LEN)
    model = Transformer(cfg)
    model.load_weights(dict(model.state_dict()))
    return model.eval(), tiny[1]


def check_pool(engine: LLMEngine) -> None:
    pool, sched = engine.kv.pool, engine.scheduler
    held = Counter(b for r in sched.running for b in r.block_ids)
    assert not any(r.block_ids for r in sched.waiting), "a waiting request holds blocks"
    assert pool.ref_cnt == [held[b] for b in range(pool.num_blocks)], "a reference is off"
    plain, evictable = set(pool._plain), set(pool._evictable)
    assert len(plain) == len(pool._plain), "a block is on the free stack twice"
    assert not plain & evictable, "a block is in both free lists"
    assert plain | evictable == {b for b in range(pool.num_blocks) if not held[b]}
    for b in evictable:
        key = pool.block_key[b]
        assert key is not None and pool.lookup(key) == b, "an evictable block is not findable"
    for r in sched.running:  # a held block keeps the content it was registered with
        for j in range(r.num_registered_blocks):
            assert pool.block_key[r.block_ids[j]] in (None, r.block_keys[j])


def refuse_held_evictions(engine: LLMEngine) -> None:
    """Fail the moment the pool hands out (evicts or reuses) a block someone holds."""
    pool = engine.kv.pool
    take = pool._take

    def checked_take() -> int:
        b = take()
        assert pool.ref_cnt[b] == 0, f"block {b} handed out while held"
        return b

    pool._take = checked_take


def fresh_kv(model: Transformer, tokens: list[int], block_size: int) -> list[torch.Tensor]:
    """Per layer, K and V of `tokens` from one prefill in a fresh pool: (2, len, heads, dim)."""
    kv = KVCacheManager(-(-len(tokens) // block_size), block_size)
    runner = ModelRunner(model, kv.num_blocks, block_size, get_backend("auto", model.device))
    r = Request("fresh", tokens, SamplingParams(max_tokens=1), 1, [], seed=0)
    assert kv.allocate(r, len(tokens))
    batch = runner.prepare_inputs(step_message([(r, len(tokens))]))
    with torch.inference_mode():
        model(batch.input_ids, batch.positions, batch.ctx)
    return [cache_rows(k, v, r.block_ids, len(tokens)) for k, v in runner.kv_caches]


def cache_rows(k: torch.Tensor, v: torch.Tensor, blocks: list[int], n: int) -> torch.Tensor:
    """The first n token rows of these blocks, K and V stacked: (2, n, heads, dim)."""
    return torch.stack([k[blocks].flatten(0, 1)[:n], v[blocks].flatten(0, 1)[:n]])


request = st.tuples(
    st.integers(0, 2),  # which shared prefix (2: none)
    st.integers(0, 20),  # its length used
    st.integers(1, 12),  # own tokens after it
    st.integers(1, 10),  # max_tokens
    st.integers(0, 8),  # arrival step
    st.one_of(st.none(), st.integers(0, 25)),  # abort at this step (None: never)
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    requests=st.lists(request, min_size=1, max_size=8),
    num_blocks=st.integers(2, 16),
    block_size=st.sampled_from([1, 2, 4]),
    max_num_seqs=st.integers(1, 4),
    budget=st.integers(1, 32),
    temperature=st.sampled_from([0.0, 1.0]),
    seed=st.integers(0, 3),
)
def test_random_shared_prefix_streams_keep_references_and_contents_right(
    tiny2, requests, num_blocks, block_size, max_num_seqs, budget, temperature, seed
):
    model, tok = tiny2
    config = EngineConfig(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        seed=seed,
    )
    engine = LLMEngine(model, tok, config)
    refuse_held_evictions(engine)
    gen = torch.Generator().manual_seed(seed)
    shared = [torch.randint(2, TINY_VOCAB, (20,), generator=gen).tolist() for _ in range(2)]
    prompts = []
    for which, used, own, *_ in requests:
        head = shared[which][:used] if which < 2 else []
        prompt = head + torch.randint(2, TINY_VOCAB, (own,), generator=gen).tolist()
        prompts.append(prompt[: engine.max_model_len - 1])  # a tiny pool cuts the context
    finished: dict[str, object] = {}
    for step in range(400):
        for i, (*_, max_tokens, arrive, _) in enumerate(requests):
            if arrive == step:
                params = SamplingParams(max_tokens=max_tokens, temperature=temperature)
                engine.add_request(None, params, str(i), prompts[i])
        for i, (*_, abort_at) in enumerate(requests):
            if abort_at == step and str(i) not in finished:
                if (out := engine.abort(str(i))) is not None:
                    finished[str(i)] = out
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        check_pool(engine)
        if step > 8 and not engine.has_unfinished():
            break
    assert not engine.has_unfinished(), "the engine stopped making progress"
    assert sorted(finished, key=int) == [str(i) for i in range(len(requests))]
    pool = engine.kv.pool
    assert pool.ref_cnt == [0] * num_blocks and pool.num_free == num_blocks
    stats = engine.stats()
    assert 0 <= stats.prefix_cache_hits <= stats.prefix_cache_queries
    for i, out in finished.items():
        assert 0 <= out.num_cached_tokens <= max(0, len(prompts[int(i)]) - 1)

    # A sample of the blocks still cached hold what a fresh prefill of their tokens computes.
    prefixes = {}  # key -> the tokens up to the end of that block
    for i, out in finished.items():
        tokens, parent = prompts[int(i)] + list(out.token_ids), None
        for j in range(len(tokens) // block_size):
            block = tokens[j * block_size : (j + 1) * block_size]
            key = block_key(parent, block, engine.kv.extra_key)
            prefixes[key] = tokens[: (j + 1) * block_size]
            parent = hash(key)
    cached = sorted(pool._cached.items(), key=lambda kb: kb[1])[:3]
    for key, b in cached:
        tokens = prefixes[key]
        want = fresh_kv(model, tokens, block_size)
        for (k, v), w in zip(engine.runner.kv_caches, want, strict=True):
            got = cache_rows(k, v, [b], block_size)
            torch.testing.assert_close(got, w[:, -block_size:], rtol=1e-4, atol=1e-5)
