"""BlockPool and KVCacheManager: the CPU bookkeeping of which KV blocks each request owns.

The founding design's invariants (../shared/seed/paged_kv_cache.py): blocks of one size from one
pool, lowest id first, LIFO reuse of blocks without cached content (cached ones wait in eviction
order: tests/test_prefix_cache.py), a double free is an error, `peak_used`, blocks allocated as a
request grows, and accounting that adds up. No model and no tensors here."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tinyllm.engine.sampling_params import SamplingParams
from tinyllm.engine.sched.block_pool import BlockPool
from tinyllm.engine.sched.kv_cache_manager import KVCacheManager
from tinyllm.engine.sched.request import Request


def make_request(request_id: str = "r", prompt_len: int = 1) -> Request:
    return Request(
        request_id,
        list(range(prompt_len)),
        SamplingParams(max_tokens=16),
        16,
        eos_token_ids=[],
        seed=0,
    )


# -- BlockPool ------------------------------------------------------------------------------


def test_pool_hands_out_lowest_ids_first():
    pool = BlockPool(6)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(1) == [2]
    assert pool.allocate(3) == [3, 4, 5]
    assert pool.num_free == 0 and pool.num_used == 6


def test_pool_reuses_freed_blocks_last_in_first_out():
    pool = BlockPool(5)
    assert pool.allocate(5) == [0, 1, 2, 3, 4]
    pool.free([1])
    pool.free([3])
    assert pool.allocate(1) == [3]  # the last freed comes back first
    assert pool.allocate(1) == [1]
    pool.free([0, 4])  # one request's blocks: its deepest (4) goes on the stack first, then 0
    assert pool.allocate(2) == [0, 4]


def test_pool_prefers_a_freed_block_to_a_never_used_one():
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    pool.free([1])
    assert pool.allocate(2) == [1, 2]


def test_pool_double_free_raises_naming_the_block():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    pool.free([blocks[2]])
    with pytest.raises(ValueError, match=r"block 2 freed twice"):
        pool.free([2])
    assert pool.num_free == 2  # the failed free changed nothing


def test_pool_freeing_a_never_allocated_block_raises_naming_it():
    pool = BlockPool(4)
    pool.allocate(1)
    with pytest.raises(ValueError, match=r"block 3 freed twice \(or never allocated\)"):
        pool.free([3])
    assert pool.num_used == 1


@pytest.mark.parametrize("bad", [-1, 4])
def test_pool_freeing_an_id_outside_the_pool_raises_value_error(bad):
    pool = BlockPool(4)
    assert pool.allocate(4) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match=f"block {bad}"):
        pool.free([bad])
    assert pool.num_used == 4 and pool.ref_cnt == [1, 1, 1, 1]


def test_pool_a_bad_list_frees_nothing():
    pool = BlockPool(4)
    pool.allocate(2)
    for bad in ([0, 2], [1, 1], [0, 9]):  # never allocated, twice in one list, outside
        with pytest.raises(ValueError, match="block"):
            pool.free(bad)
        assert pool.ref_cnt == [1, 1, 0, 0] and pool.num_free == 2


def test_pool_peak_used_is_the_high_water_mark():
    pool = BlockPool(8)
    a = pool.allocate(3)
    b = pool.allocate(2)
    assert pool.peak_used == 5
    pool.free(a)
    assert pool.num_used == 2 and pool.peak_used == 5  # freeing does not lower the peak
    pool.allocate(2)
    assert pool.num_used == 4 and pool.peak_used == 5
    pool.allocate(3)
    assert pool.num_used == 7 and pool.peak_used == 7
    pool.free(b)
    assert pool.peak_used == 7


def test_pool_allocating_more_than_free_raises_with_the_numbers_and_takes_nothing():
    pool = BlockPool(4)
    pool.allocate(3)
    with pytest.raises(ValueError, match=r"asked for 2 KV blocks, 1 of 4 free"):
        pool.allocate(2)
    assert pool.num_free == 1 and pool.ref_cnt == [1, 1, 1, 0]
    assert pool.allocate(1) == [3]


def test_pool_reference_counts_a_shared_block_is_free_after_the_last_free():
    """The interface prefix caching uses: a second owner raises the count by hand."""
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    assert pool.ref_cnt[b] == 1
    pool.ref_cnt[b] += 1  # a second request shares the block
    pool.free([b])
    assert pool.ref_cnt[b] == 1
    assert pool.num_used == 1 and pool.num_free == 2
    assert b not in pool.allocate(2)  # still owned: not handed out again
    pool.free([1, 2])
    pool.free([b])
    assert pool.ref_cnt == [0, 0, 0] and pool.num_free == 3
    with pytest.raises(ValueError, match=f"block {b}"):
        pool.free([b])
    assert pool.allocate(1) == [b]  # freed last, reused first


# -- KVCacheManager -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("steps", "expected_blocks"),
    [
        ([1], 1),
        ([4], 1),  # exactly one block
        ([5], 2),  # one token into the second block
        ([1, 3], 1),  # grows to 4 tokens: still one block
        ([1, 3, 1], 2),
        ([3, 6], 3),  # 9 tokens
        ([8, 4], 3),  # 12 tokens: on the boundary, no fourth block
        ([8, 4, 1], 4),
    ],
)
def test_manager_grows_lazily_to_ceil_of_computed_plus_new(steps, expected_blocks):
    kv = KVCacheManager(num_blocks=10, block_size=4)
    r = make_request()
    for n in steps:
        assert kv.allocate(r, n)
        assert len(r.block_ids) == math.ceil((r.num_computed_tokens + n) / 4)
        r.num_computed_tokens += n
    assert len(r.block_ids) == expected_blocks
    assert r.block_ids == list(range(expected_blocks))  # appended in order, lowest first
    assert kv.pool.num_used == expected_blocks


def test_manager_allocate_counts_from_num_computed_tokens():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    r = make_request()
    r.block_ids = kv.pool.allocate(2)  # holds 8 tokens' worth
    r.num_computed_tokens = 7
    assert kv.allocate(r, 1)  # 8 tokens: fits in what it holds
    assert r.block_ids == [0, 1]
    r.num_computed_tokens = 8
    assert kv.allocate(r, 1)  # 9 tokens: a third block
    assert r.block_ids == [0, 1, 2]


def test_manager_allocate_returns_false_and_allocates_nothing_when_short():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a, b = make_request("a"), make_request("b")
    assert kv.allocate(a, 8)  # 2 blocks, 1 left
    a.num_computed_tokens = 8
    assert not kv.allocate(b, 5)  # needs 2 blocks
    assert b.block_ids == [] and kv.pool.num_free == 1
    assert not kv.allocate(a, 5)  # 13 tokens: needs 2 more, one is free
    assert a.block_ids == [0, 1] and kv.pool.num_free == 1
    assert kv.pool.ref_cnt == [1, 1, 0]
    assert kv.allocate(b, 4)  # exactly the last block
    assert b.block_ids == [2] and kv.pool.num_free == 0


def test_manager_free_returns_every_block():
    kv = KVCacheManager(num_blocks=6, block_size=2)
    a, b = make_request("a"), make_request("b")
    kv.allocate(a, 5)
    kv.allocate(b, 2)
    assert kv.pool.num_used == 4
    kv.free(a)
    assert a.block_ids == [] and kv.pool.num_used == 1
    assert kv.pool.ref_cnt == [0, 0, 0, 1, 0, 0]
    kv.free(b)
    kv.free(b)  # nothing left to give back: not a double free
    assert kv.pool.num_free == 6 and kv.pool.ref_cnt == [0] * 6
    assert kv.pool.peak_used == 4


def test_manager_fits_ever_at_block_boundaries():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    assert kv.capacity_tokens == 12
    assert kv.fits_ever(1)
    assert kv.fits_ever(12)
    assert not kv.fits_ever(13)
    kv.allocate(make_request(), 12)  # what is in use does not matter: "with the pool to itself"
    assert kv.fits_ever(12) and not kv.fits_ever(13)


def test_manager_can_hold_at_block_boundaries():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    other, r = make_request("other"), make_request("r")
    kv.allocate(other, 8)  # 2 blocks
    kv.allocate(r, 3)  # 1 block; 1 left free
    r.num_computed_tokens = 3
    assert kv.can_hold(r, 4)  # needs nothing new
    assert kv.can_hold(r, 8)  # one more block: the free one
    assert not kv.can_hold(r, 9)  # two more
    fresh = make_request("fresh")
    assert kv.can_hold(fresh, 4)
    assert not kv.can_hold(fresh, 5)
    assert kv.pool.num_free == 1  # asking allocated nothing


def test_manager_as_the_slot_cache_one_block_per_request_from_the_first_token():
    """The baseline: block_size = max_model_len, so a request's first token takes its one
    block and it never needs another."""
    max_model_len = 16
    kv = KVCacheManager(num_blocks=2, block_size=max_model_len)
    a, b, c = make_request("a"), make_request("b"), make_request("c")
    assert kv.allocate(a, 1)
    assert a.block_ids == [0]
    a.num_computed_tokens = 1
    for _ in range(max_model_len - 1):  # decode up to max_model_len tokens: no growth
        assert kv.allocate(a, 1)
        a.num_computed_tokens += 1
        assert a.block_ids == [0]
    assert kv.blocks_for(1) == kv.blocks_for(max_model_len) == 1
    assert kv.allocate(b, 5) and b.block_ids == [1]
    assert not kv.can_hold(c, 1)  # every slot taken
    assert not kv.allocate(c, 1) and c.block_ids == []
    kv.free(a)
    assert kv.allocate(c, max_model_len) and c.block_ids == [0]


# -- property test --------------------------------------------------------------------------

NUM_REQUESTS = 5

op = st.one_of(
    st.tuples(st.just("alloc"), st.integers(0, NUM_REQUESTS - 1), st.integers(0, 12)),
    st.tuples(st.just("free"), st.integers(0, NUM_REQUESTS - 1), st.just(0)),
)


def _check_accounting(kv: KVCacheManager, requests: list[Request]) -> None:
    pool = kv.pool
    owned = [b for r in requests for b in r.block_ids]
    assert len(owned) == len(set(owned)), "a block is owned by two requests"
    assert pool.num_used == len(owned), "used blocks != blocks owned"
    assert pool.num_free + pool.num_used == pool.num_blocks
    assert pool.ref_cnt == [1 if b in owned else 0 for b in range(pool.num_blocks)]
    assert pool.num_used <= pool.peak_used <= pool.num_blocks
    for r in requests:  # lazily grown: exactly the blocks its computed tokens need
        assert len(r.block_ids) == kv.blocks_for(r.num_computed_tokens)


@settings(max_examples=300, deadline=None, database=None)
@given(
    num_blocks=st.integers(1, 16),
    block_size=st.sampled_from([1, 2, 3, 4, 8, 16]),
    ops=st.lists(op, max_size=60),
)
def test_manager_accounting_under_random_allocate_grow_free(num_blocks, block_size, ops):
    kv = KVCacheManager(num_blocks, block_size)
    requests = [make_request(str(i)) for i in range(NUM_REQUESTS)]
    for kind, i, n in ops:
        r = requests[i]
        if kind == "alloc":
            need = kv.blocks_for(r.num_computed_tokens + n) - len(r.block_ids)
            expected = need <= kv.pool.num_free
            before = list(r.block_ids)
            assert kv.allocate(r, n) is expected
            if expected:
                assert r.block_ids[: len(before)] == before  # grows, never reshuffles
                r.num_computed_tokens += n  # the step ran
            else:
                assert r.block_ids == before
        else:
            kv.free(r)
            assert r.block_ids == []
            r.num_computed_tokens = 0
        _check_accounting(kv, requests)
    for r in requests:
        kv.free(r)
    assert kv.pool.ref_cnt == [0] * num_blocks
    assert kv.pool.num_free == num_blocks and kv.pool.num_used == 0
    # the free list holds every block exactly once
    assert sorted(kv.pool.allocate(num_blocks)) == list(range(num_blocks))
