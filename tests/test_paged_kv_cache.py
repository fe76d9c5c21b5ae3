"""The block allocator and the paged/slot caches against a plain per-sequence reference."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tinyllm.engine.kv_cache import KVCache, PackedKVCache, SlotKVCache
from tinyllm.engine.paged_kv_cache import BlockAllocator, OutOfBlocks, PagedKVCache
from tinyllm.model.config import ModelConfig
from tinyllm.model.llama import Transformer

H, D, LAYERS = 2, 4, 2


class _NoRope:
    """begin_step hands back rope.at(positions); record them instead of rotating."""

    def at(self, positions):
        self.positions = positions
        return positions, positions


def test_allocator_lowest_first_lifo_and_double_free():
    a = BlockAllocator(4, 16)
    assert [a.alloc() for _ in range(3)] == [0, 1, 2]
    a.free([1])
    assert a.alloc() == 1  # reused LIFO
    a.alloc()
    with pytest.raises(OutOfBlocks, match="all 4 KV blocks in use"):
        a.alloc()
    a.free([2])
    with pytest.raises(ValueError, match="block 2 freed twice"):
        a.free([2])
    assert a.peak_used == 4 and a.num_used == 3


def _prefill(lengths: list[int], gen: torch.Generator) -> tuple[KVCache, list]:
    """A left-padded prefill cache with random K/V; returns it and each row's real tokens."""
    L = max(lengths)
    pads = [L - n for n in lengths]
    pre = KVCache(LAYERS, pads, H, D, L, torch.float32, "cpu")
    for i in range(LAYERS):
        pre.k[i].copy_(torch.randn(pre.k[i].shape, generator=gen))
        pre.v[i].copy_(torch.randn(pre.v[i].shape, generator=gen))
    pre.pos = L
    rows = [
        [(pre.k[i][j, :, p:].clone(), pre.v[i][j, :, p:].clone()) for i in range(LAYERS)]
        for j, p in enumerate(pads)
    ]
    return pre, rows


def _decode(cache, ref: dict, gen: torch.Generator) -> None:
    """One decode step with random new K/V; checks what attention reads against the reference."""
    rope = _NoRope()
    cache.begin_step(1, rope)
    rows = cache.active_slots()
    assert rope.positions[:, 0].tolist() == [cache.lens[s] for s in rows]
    mask = cache.attn_kwargs["attn_mask"][:, 0, 0]
    for i in range(LAYERS):
        k = torch.randn(len(rows), H, 1, D, generator=gen)
        v = torch.randn(len(rows), H, 1, D, generator=gen)
        ks, vs = cache.layer(i).update(k, v)
        for r, s in enumerate(rows):
            ref_k, ref_v = ref[s][i]
            ref[s][i] = (torch.cat([ref_k, k[r]], 1), torch.cat([ref_v, v[r]], 1))
            n = ref[s][i][0].shape[1]
            assert mask[r, :n].all() and not mask[r, n:].any()
            torch.testing.assert_close(ks[r, :, :n], ref[s][i][0], rtol=0, atol=0)
            torch.testing.assert_close(vs[r, :, :n], ref[s][i][1], rtol=0, atol=0)
    cache.end_step(1)


def _check_ownership(cache: PagedKVCache) -> None:
    owned = [b for s in cache.active_slots() for b in cache.tables[s]]
    assert len(owned) == len(set(owned)), "a block is owned by two live sequences"
    assert len(owned) == cache.alloc.num_used, "a block leaked"
    for s in range(cache.n_slots):
        table = cache._table_dev[s].tolist()
        if cache.active[s]:
            assert table[: len(cache.tables[s])] == cache.tables[s]
            assert len(cache.tables[s]) * cache.bs >= cache.lens[s]
        assert all(b == cache.scratch for b in table[len(cache.tables[s]) :])


@settings(max_examples=60, deadline=None)
@given(
    n_blocks=st.integers(1, 12),
    block_size=st.sampled_from([1, 2, 4]),
    ops=st.lists(
        st.tuples(st.sampled_from(["admit", "step", "release"]), st.integers(1, 9)), max_size=25
    ),
)
def test_paged_cache_random_workload(n_blocks, block_size, ops):
    """Random admits, decode steps (with preemption) and releases on tiny pools: reads always
    equal what was written, no block is shared or leaked, and everything comes back."""
    gen = torch.Generator().manual_seed(0)
    cache = PagedKVCache(LAYERS, 3, H, D, n_blocks, block_size, 24, torch.float32, "cpu")
    ref: dict = {}
    for op, n in ops:
        if op == "admit" and cache.free_slots() and cache.can_admit([n]):
            pre, rows = _prefill([n], gen)
            slot = cache.free_slots()[0]
            cache.admit([slot], pre)
            ref[slot] = rows[0]
        elif op == "step" and cache.active_slots():
            for v in cache.reserve_step():
                del ref[v]
            if cache.active_slots() and max(cache.lens) < cache.max_len:
                _decode(cache, ref, gen)
        elif op == "release" and cache.active_slots():
            s = cache.active_slots()[n % len(cache.active_slots())]
            cache.release(s)
            del ref[s]
        _check_ownership(cache)
    for s in cache.active_slots():
        cache.release(s)
    assert cache.alloc.num_used == 0


def test_reserve_step_preempts_newest_first():
    cache = PagedKVCache(LAYERS, 3, H, D, 3, 2, 16, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(0)
    for slot in range(3):  # three sequences of one full block each: the pool is full
        pre, _ = _prefill([2], gen)
        cache.admit([slot], pre)
    assert not cache.can_admit([1])
    assert cache.reserve_step() == [2, 1]  # each needs a new block; free the newest two
    assert cache.active_slots() == [0] and cache.alloc.num_free == 2


def test_batched_admit_drops_padding_and_slot_cache_matches():
    gen = torch.Generator().manual_seed(1)
    pre, rows = _prefill([5, 2, 7], gen)
    paged = PagedKVCache(LAYERS, 4, H, D, 9, 4, 32, torch.float32, "cpu")
    slot = SlotKVCache(LAYERS, 4, H, D, 32, torch.float32, "cpu")
    for cache in (paged, slot):
        cache.admit([0, 2, 3], pre)
        ref = {s: [tuple(t.clone() for t in kv) for kv in rows[j]] for j, s in enumerate([0, 2, 3])}
        assert cache.used_tokens() == 14
        for _ in range(6):
            _decode(cache, ref, gen)
    assert paged.allocated_tokens() == 4 * (3 + 2 + 4)  # ceil(11/4) + ceil(8/4) + ceil(13/4)
    assert slot.allocated_tokens() == 3 * 32


def test_packed_prefill_equals_each_prompt_alone():
    """Packing prompts end to end gives each the logits and K/V it gets alone, and admitting
    from the packed cache stores exactly those K/V."""
    torch.manual_seed(0)
    cfg = ModelConfig("llama", 50, 32, 48, 2, 4, 2, 8, 64)
    model = Transformer(cfg)
    model.load_weights(dict(model.state_dict()))
    prompts = [torch.randint(0, 50, (n,)).tolist() for n in (5, 1, 12)]
    packed = PackedKVCache(2, [len(p) for p in prompts], 2, 8, torch.float32, "cpu")
    hidden = model(torch.tensor([sum(prompts, [])]), packed)[0]
    paged = PagedKVCache(2, 3, 2, 8, 8, 4, 64, torch.float32, "cpu")
    paged.admit([2, 0, 1], packed)
    for p, slot, last in zip(prompts, [2, 0, 1], packed.last_token_index(), strict=True):
        alone = KVCache(2, [0], 2, 8, len(p), torch.float32, "cpu")
        ref = model(torch.tensor([p]), alone)[0]
        torch.testing.assert_close(hidden[last], ref[-1], atol=1e-5, rtol=0)
        blocks = torch.tensor(paged.tables[slot])
        stored = paged.k[1][blocks].reshape(-1, 2, 8)[: len(p)]  # token-major blocks
        torch.testing.assert_close(stored, alone.k[1][0].transpose(0, 1), atol=1e-5, rtol=0)
