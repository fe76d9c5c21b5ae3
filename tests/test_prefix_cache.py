"""Prefix caching: the block pool's cached blocks and eviction order, the manager's matching,
and, on the default model, outputs and logprobs bit-identical with caching on and off.

The engine-level property test (random streams, tiny pools, preemption) is in
tests/test_prefix_cache_properties.py."""

import copy
import dataclasses

import pytest

from tinyllm.engine.engine import LLMEngine
from tinyllm.engine.sampling_params import SamplingParams
from tinyllm.engine.sched.block_pool import BlockPool, block_key
from tinyllm.engine.sched.kv_cache_manager import KVCacheManager
from tinyllm.engine.sched.request import Request


def make_request(tokens: list[int], request_id: str = "r") -> Request:
    return Request(request_id, tokens, SamplingParams(max_tokens=4), 4, [], seed=0)


def cache_chain(pool: BlockPool, blocks: list[int], tag: int) -> None:
    """Register held blocks as one chain of cached content."""
    parent = None
    for i, b in enumerate(blocks):
        key = block_key(parent, [tag, i], None)
        assert pool.cache(b, key)
        parent = hash(key)


def two_cached_chains(pool: BlockPool, length: int) -> tuple[list[int], list[int]]:
    """Two held chains of `length` cached blocks each (tags 1 and 2)."""
    a, b = pool.allocate(length), pool.allocate(length)
    cache_chain(pool, a, tag=1)
    cache_chain(pool, b, tag=2)
    return a, b


# -- BlockPool: cached blocks and the eviction order ----------------------------------------


def test_pool_evicts_least_recently_freed_first_deepest_of_a_chain_first():
    pool = BlockPool(6)
    a, b = two_cached_chains(pool, 3)
    pool.free(a)  # released first: least recently used
    pool.free(b)
    assert pool.num_free == 6 and pool.num_cached == 6
    # a's chain first, its deepest block first, then b's the same way
    assert pool.allocate(6) == [a[2], a[1], a[0], b[2], b[1], b[0]]
    assert pool.num_cached == 0 and pool.num_evictions == 6


def test_pool_hands_out_plain_blocks_before_evicting_cached_ones():
    pool = BlockPool(5)
    cached = pool.allocate(2)
    cache_chain(pool, cached, tag=1)
    plain = pool.allocate(2)
    pool.free(cached)
    pool.free(plain)
    # plain ones first (LIFO, as before), then the never-used block, then the cached ones
    assert pool.allocate(3) == [plain[0], plain[1], 4]
    assert pool.num_evictions == 0 and pool.num_cached == 2
    assert pool.allocate(1) == [cached[1]]
    assert pool.lookup(block_key(None, [1, 0], None)) == cached[0]


def test_pool_touching_a_cached_block_takes_it_out_of_the_queue_and_refreshes_it():
    pool = BlockPool(4)
    a, b = two_cached_chains(pool, 2)
    pool.free(a)
    pool.free(b)
    pool.touch([a[0]])  # a request shares a's first block: ref 0 -> 1
    assert pool.ref_cnt[a[0]] == 1 and not pool.is_evictable(a[0])
    assert pool.num_free == 3 and pool.num_used == 1
    assert a[0] not in pool.allocate(3)  # held: never evicted, even with nothing else left
    with pytest.raises(ValueError, match="asked for 1 KV blocks, 0 of 4 free"):
        pool.allocate(1)
    pool.free([a[0]])
    assert pool.is_evictable(a[0]) and pool.lookup(block_key(None, [1, 0], None)) == a[0]


def test_pool_freed_again_a_block_is_the_most_recently_used():
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    for i, b in enumerate(blocks):
        assert pool.cache(b, block_key(None, [i], None))
    pool.free(blocks)  # queue: 2, 1, 0
    pool.touch([2])
    pool.free([2])  # used again just now: last in the queue
    assert pool.allocate(3) == [1, 0, 2]


def test_pool_a_second_block_with_the_same_content_stays_plain():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    key = block_key(None, [7, 7], "m")
    assert pool.cache(a, key)
    assert not pool.cache(b, key)  # computed twice at once: the first one is kept
    assert pool.lookup(key) == a and pool.block_key[b] is None
    pool.free([b])
    assert not pool.is_evictable(b) and pool.num_free == 2


def test_pool_with_caching_off_caches_nothing():
    pool = BlockPool(2, enable_caching=False)
    (b,) = pool.allocate(1)
    assert not pool.cache(b, block_key(None, [1], None))
    assert pool.num_cached == 0


def test_pool_reset_forgets_free_and_held_cached_blocks():
    pool = BlockPool(4)
    held, free = two_cached_chains(pool, 2)
    pool.free(free)
    assert pool.reset_cache() == 4
    assert pool.num_cached == 0 and pool.block_key == [None] * 4
    assert pool.lookup(block_key(None, [1, 0], None)) is None
    assert sorted(pool.allocate(2)) == sorted(free) and pool.num_evictions == 0
    pool.free(held)  # no longer cached: plain free blocks
    assert pool.allocate(2) == held


# -- KVCacheManager: matching ---------------------------------------------------------------


def run_request(kv: KVCacheManager, tokens: list[int], request_id: str = "r") -> Request:
    """Admit a request as the scheduler does, compute its whole prompt, free it."""
    r = make_request(tokens, request_id)
    matched = kv.match(r)
    assert kv.can_admit(r, matched, r.num_tokens + 1)
    kv.admit(r, matched)
    assert kv.allocate(r, r.num_tokens - r.num_computed_tokens)
    r.num_computed_tokens = r.num_tokens
    kv.free(r)
    return r


@pytest.mark.parametrize(
    ("first", "second", "hit"),
    [
        (list(range(8)), list(range(8)), 4),  # ends on a boundary: the last block recomputed
        (list(range(8)), list(range(9)), 8),  # one token past it: both blocks
        (list(range(8)), list(range(10)), 8),  # two past it: both blocks
        (list(range(10)), list(range(6)) + [99] * 4, 4),  # diverges mid-block
        (list(range(12)), list(range(7)), 4),  # contained in a cached prompt
        (list(range(12)), [99] + list(range(1, 12)), 0),  # differs in the first token
        (list(range(3)), list(range(3)), 0),  # no full block
    ],
)
def test_manager_matches_whole_blocks_before_the_last_token(first, second, hit):
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    a = run_request(kv, first, "a")
    assert a.num_cached_tokens == 0
    b = run_request(kv, second, "b")
    assert b.num_cached_tokens == hit
    assert kv.prefix_cache_queries == len(first) + len(second)
    assert kv.prefix_cache_hits == hit


def test_manager_extra_key_separates_models():
    """Blocks computed under one extra key (model, weight format) never match another's."""
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True, extra_key="m1")
    run_request(kv, list(range(10)))
    assert len(kv.match(make_request(list(range(10))))) == 2
    kv.extra_key = "m2"
    assert kv.match(make_request(list(range(10)))) == []


def test_manager_counts_matched_free_blocks_as_taken_at_admission():
    kv = KVCacheManager(num_blocks=3, block_size=4, enable_prefix_caching=True)
    run_request(kv, list(range(10)))  # 2 cached blocks, free; 1 plain
    r = make_request(list(range(10)))
    matched = kv.match(r)
    assert len(matched) == 2 and kv.pool.num_free == 3
    # 10 tokens + 1: 3 blocks, 2 shared: one more, and one is left once the 2 are taken
    assert kv.can_admit(r, matched, 11)
    assert not kv.can_admit(r, matched, 13)  # 4 blocks: 2 more, only 1 left
    kv.admit(r, matched)
    assert kv.pool.num_free == 1 and r.num_computed_tokens == 8


def test_manager_caches_blocks_filled_by_decoding():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    r = make_request(list(range(3)))
    kv.admit(r, kv.match(r))
    assert kv.allocate(r, 3)
    r.num_computed_tokens = 3
    r.all_token_ids.append(50)  # sampled; its K/V is computed by the next step
    assert kv.allocate(r, 1)
    r.num_computed_tokens += 1  # the first block is now full
    assert kv.pool.num_cached == 0
    r.all_token_ids.append(51)
    assert kv.allocate(r, 1)  # registered before the request grows
    assert kv.pool.num_cached == 1
    r.num_computed_tokens += 1
    for t in (52, 53, 54):
        r.all_token_ids.append(t)
        assert kv.allocate(r, 1)
        r.num_computed_tokens += 1
    kv.free(r)  # what the last step filled is registered on the way out
    assert kv.pool.num_cached == 2
    nxt = make_request([0, 1, 2, 50, 51, 52, 53, 54, 8, 9])  # the next turn: history + new
    assert len(kv.match(nxt)) == 2


# -- the default model: caching on and off give the same bits --------------------------------


@pytest.fixture(scope="module")
def llm_on():
    """The default configuration (int4 weights, CPU attention, budget 512) with prefix caching."""
    from tinyllm import LLM

    return LLM(num_blocks=512, max_model_len=2048)


def variant(llm, **changes):
    """The same model and tokenizer behind an engine with other settings."""
    other = copy.copy(llm)
    config = dataclasses.replace(llm.engine.config, **changes)
    other.engine = LLMEngine(llm.engine.model, llm.tokenizer, config)
    return other


@pytest.fixture(scope="module")
def engines(llm_on):
    """(caching on, caching off) at the default budget and at a small chunked budget."""
    return {
        "default": (llm_on, variant(llm_on, enable_prefix_caching=False)),
        "chunked": (
            variant(llm_on, max_num_batched_tokens=16),
            variant(llm_on, max_num_batched_tokens=16, enable_prefix_caching=False),
        ),
    }


GREEDY = SamplingParams(max_tokens=6, temperature=0, logprobs=3)
SYSTEM = (
    "You are a careful assistant for a small bakery. Answer in one short sentence, mention "
    "prices in euros, and never invent opening hours that you were not told about."
)


def chat_prompt(llm, *turns: str) -> list[int]:
    messages = [{"role": "system", "content": SYSTEM}]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return llm.tokenizer.encode_chat(messages)[1]


def same_outputs(on, off, batches: list[list[list[int]]], params=GREEDY, exact=True):
    """Run each batch of prompts in turn on both engines: the token ids compared, the logprobs
    too, exactly (floats by ==) unless `exact` is off, and the caching engine's outputs
    returned."""
    results = []
    for prompts in batches:
        got = on.generate(prompts, params, use_tqdm=False)
        want = off.generate(prompts, params, use_tqdm=False)
        for g, w in zip(got, want, strict=True):
            assert g.token_ids == w.token_ids
            if exact:
                assert g.outputs[0].logprobs == w.outputs[0].logprobs  # bit-identical floats
            assert w.num_cached_tokens == 0
        results.append(got)
    return results


@pytest.fixture(params=["default", "chunked"])
def pair(request, engines):
    on, off = engines[request.param]
    on.engine.reset_prefix_cache()
    return on, off


def test_shared_system_prompt_batch(pair):
    on, off = pair
    questions = ["How much is a croissant?", "Do you sell rye bread?", "Is there coffee?"]
    prompts = [chat_prompt(on, q) for q in questions]
    first, rest = same_outputs(on, off, [prompts[:1], prompts[1:]])
    assert first[0].num_cached_tokens == 0
    for prompt, out in zip(prompts[1:], rest, strict=True):
        # the whole blocks it shares with the first prompt (the system prompt) came from the
        # cache; the two in the second batch are admitted in one step, so not from each other
        common = next(i for i, (a, b) in enumerate(zip(prompt, prompts[0], strict=False)) if a != b)
        assert out.num_cached_tokens == common // 16 * 16 > 0


def test_multi_turn_chat_hits_the_previous_prompt_and_answer_bit_for_bit(pair):
    """Each turn finds the previous turn's prompt and answer (the answer's K/V computed by
    decode steps): tokens and logprobs equal caching off's, turn after turn."""
    on, off = pair
    long = dataclasses.replace(GREEDY, max_tokens=24)  # answers cross a block boundary
    history: list[str] = []
    previous = None
    for message in ("What goes into a baguette?", "And into a brioche?", "Which keeps longer?"):
        prompt = chat_prompt(on, *history, message)
        (out,) = same_outputs(on, off, [[prompt]], long)[0]
        if previous is not None:
            seen, answer = previous  # the answer's last token was sampled, never computed
            assert prompt[: len(seen) + len(answer) - 1] == seen + answer[:-1]
            assert out.num_cached_tokens == (len(seen) + len(answer) - 1) // 16 * 16
            assert out.num_cached_tokens > len(seen)
        history += [message, out.text]
        previous = prompt, out.token_ids


def test_block_boundaries_divergence_and_containment_hit_exactly(pair):
    """A deterministic scenario: every hit count known in advance, and the counters agree."""
    on, off = pair
    base = chat_prompt(on, "List three kinds of bread and say which one keeps longest.")
    assert len(base) >= 50
    stats0 = on.engine.stats()
    cases = [  # (prompt, tokens it should find cached)
        (base[:48], 0),  # three whole blocks, nothing cached yet
        (base[:48], 32),  # the same prompt again: the last block is recomputed for its logits
        (base[:49], 48),  # one token past it: all three blocks, that token by prefill
        (base[:50], 48),  # two past it: all three blocks
        (base[:40] + base[41:45], 32),  # diverges mid-block
        (base[:20], 16),  # contained in a cached prompt
        (base, 48),  # longer: every cached block, then the rest computed
    ]
    outputs = same_outputs(on, off, [[p] for p, _ in cases])
    assert [o.num_cached_tokens for (o,) in outputs] == [hit for _, hit in cases]
    stats = on.engine.stats()
    assert stats.prefix_cache_queries - stats0.prefix_cache_queries == sum(len(p) for p, _ in cases)
    assert stats.prefix_cache_hits - stats0.prefix_cache_hits == sum(hit for _, hit in cases)


def test_reset_prefix_cache_forgets_every_block(engines):
    on, _ = engines["default"]
    prompt = chat_prompt(on, "Is the sourdough vegan?")
    on.generate([prompt], GREEDY, use_tqdm=False)
    assert on.reset_prefix_cache() > 0
    (out,) = on.generate([prompt], GREEDY, use_tqdm=False)
    assert out.num_cached_tokens == 0
    (again,) = on.generate([prompt], GREEDY, use_tqdm=False)
    assert again.num_cached_tokens == (len(prompt) - 1) // 16 * 16 > 0
