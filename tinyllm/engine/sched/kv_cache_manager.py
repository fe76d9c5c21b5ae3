"""Which KV blocks each request owns, and the prefix cache that lets requests share them.

The analogy is virtual memory:
    block table = page table (a request's `block_ids`: logical block j -> physical block)
    block       = page (block_size tokens of K and V, every layer)
    token t     = (block_ids[t // block_size], t % block_size)

All blocks are one size from one pool (block_pool.py), so a freed block fits any request: no
external fragmentation, at most block_size - 1 unused slots per request. Blocks are allocated as
a request grows, only for tokens that run. This is CPU bookkeeping only; the model runner owns
the tensors. The slot cache, the baseline, is the same manager with one block of
max_model_len tokens per request (and no prefix cache).

Prefix caching: a full block is identified by a chained key, (its parent's hash, its token ids,
the extra key: whatever else changes its K/V). Once a request has computed a full block, prompt
or output tokens alike, the block is registered under its key, so a chat's next turn finds its
previous answer too. (A token's K/V are the same bits however it was computed, on the default
CPU path: attention/cpu_kernel.cpp has one routine for every query.) A new request's tokens are
matched block by block against those keys at admission: matched blocks are shared (reference
counted, read-only) and its prefill starts at the first unmatched token. The match never
covers the last token, whose logits are needed, so the request only ever writes into blocks of
its own that are not yet full.
"""

import math

from tinyllm.engine.sched.block_pool import BlockPool, block_key
from tinyllm.engine.sched.request import Request


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = False,
        extra_key: object = None,
    ):
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.extra_key = extra_key
        self.prefix_cache_queries = 0  # tokens looked up at admission
        self.prefix_cache_hits = 0  # of those, tokens found cached

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
        self.cache_blocks(request)  # what its last step filled, before it grows
        total = request.num_computed_tokens + num_new_tokens
        if not self.can_hold(request, total):
            return False
        need = self.blocks_for(total) - len(request.block_ids)
        if need > 0:
            request.block_ids += self.pool.allocate(need)
        return True

    def free(self, request: Request) -> None:
        self.cache_blocks(request)  # what its last step filled, before the blocks go
        self.pool.free(request.block_ids)
        request.block_ids = []

    # -- prefix cache ---------------------------------------------------------------------

    def match(self, request: Request) -> list[int]:
        """The cached blocks that hold the start of a request's tokens, in order. Looks only:
        nothing is held until `admit`.

        The last token is always computed: its logits are needed (every token's, for a request
        that asks for prompt logprobs: it matches nothing). A hit changes no bit (on the
        default CPU path; tests/test_prefix_cache.py): the attention kernel computes every
        query by one routine, whatever the size of its row."""
        if not self.enable_prefix_caching or request.prompt_logprobs is not None:
            return []
        limit = (request.num_tokens - 1) // self.block_size
        self._extend_keys(request, limit)
        blocks = []
        for key in request.block_keys[:limit]:
            b = self.pool.lookup(key)
            if b is None:
                break
            blocks.append(b)
        return blocks

    def can_admit(self, request: Request, matched: list[int], num_tokens: int) -> bool:
        """Would there be free blocks for a waiting request to hold `num_tokens` tokens, its
        `matched` blocks shared? Matched blocks no one holds count as taken (they leave the
        eviction queue)."""
        taken = sum(1 for b in matched if self.pool.is_evictable(b))
        need = self.blocks_for(num_tokens) - len(matched)
        return need <= self.pool.num_free - taken

    def admit(self, request: Request, matched: list[int]) -> None:
        """Hold a waiting request's matched blocks; it starts after the tokens they hold."""
        self.pool.touch(matched)
        request.block_ids = list(matched)
        request.num_computed_tokens = len(matched) * self.block_size
        request.num_registered_blocks = len(matched)
        if request.num_cached_tokens is None:  # the first admission, not a recompute
            request.num_cached_tokens = request.num_computed_tokens
        if self.enable_prefix_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += request.num_computed_tokens

    def cache_blocks(self, request: Request) -> None:
        """Register the request's blocks that its computed tokens have filled since last time."""
        if not self.enable_prefix_caching:
            return
        full = min(request.num_computed_tokens // self.block_size, len(request.block_ids))
        self._extend_keys(request, full)
        for j in range(request.num_registered_blocks, full):
            self.pool.cache(request.block_ids[j], request.block_keys[j])
        request.num_registered_blocks = max(request.num_registered_blocks, full)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block (held blocks stay with their requests); how many."""
        return self.pool.reset_cache()

    def _extend_keys(self, request: Request, num_blocks: int) -> None:
        """Key the request's first `num_blocks` full blocks (keys depend on tokens only, so
        they are computed once and survive a preemption)."""
        keys, bs = request.block_keys, self.block_size
        while len(keys) < num_blocks:
            j = len(keys)
            parent = hash(keys[-1]) if keys else None
            tokens = request.all_token_ids[j * bs : (j + 1) * bs]
            keys.append(block_key(parent, tokens, self.extra_key))
