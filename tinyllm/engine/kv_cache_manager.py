"""Which KV blocks each request owns: a block pool and the manager that hands blocks out.

The analogy is virtual memory (the founding design, seed/paged_kv_cache.py):
    block table = page table (a request's `block_ids`: logical block j -> physical block)
    block       = page (block_size tokens of K and V, every layer)
    token t     = (block_ids[t // block_size], t % block_size)

All blocks are one size from one pool, so a freed block fits any request: no external
fragmentation, at most block_size - 1 unused slots per request. Blocks are allocated as a
request grows, only for tokens that run. This is CPU bookkeeping only; the model runner owns
the tensors. The slot cache, the baseline, is the same manager with one block of
max_model_len tokens per request.
"""

import math
from collections import Counter

from tinyllm.engine.request import Request


class BlockPool:
    """Blocks with reference counts and a free list. Lowest ids are handed out first, freed
    blocks are reused last-in first-out. A block is free when its count drops to 0; counts
    above 1 are for sharing (prefix caching)."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: pop() gives block 0 first
        self.ref_cnt = [0] * num_blocks
        self.peak_used = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise ValueError(
                f"asked for {n} KV blocks, {len(self._free)} of {self.num_blocks} free"
            )
        blocks = [self._free.pop() for _ in range(n)]
        for b in blocks:
            self.ref_cnt[b] = 1
        self.peak_used = max(self.peak_used, self.num_used)
        return blocks

    def free(self, blocks: list[int]) -> None:
        for b, n in Counter(blocks).items():  # check all first: a bad list frees nothing
            if not 0 <= b < self.num_blocks:
                raise ValueError(f"block {b} is not in the pool of {self.num_blocks}")
            if self.ref_cnt[b] < n:
                raise ValueError(f"block {b} freed twice (or never allocated)")
        for b in blocks:
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self._free.append(b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def fits_ever(self, num_tokens: int) -> bool:
        """Could a request holding this many tokens run at all, with the pool to itself?"""
        return self.blocks_for(num_tokens) <= self.pool.num_blocks

    def can_hold(self, request: Request, num_tokens: int) -> bool:
        """Are there free blocks for the request to hold `num_tokens` tokens in all?"""
        need = self.blocks_for(num_tokens) - len(request.block_ids)
        return need <= self.pool.num_free

    def allocate(self, request: Request, num_new_tokens: int) -> bool:
        """Grow the request's blocks to hold its computed tokens plus `num_new_tokens`.
        False, with nothing allocated, if the pool is short."""
        total = request.num_computed_tokens + num_new_tokens
        if not self.can_hold(request, total):
            return False
        need = self.blocks_for(total) - len(request.block_ids)
        if need > 0:
            request.block_ids += self.pool.allocate(need)
        return True

    def free(self, request: Request) -> None:
        self.pool.free(request.block_ids)
        request.block_ids = []
