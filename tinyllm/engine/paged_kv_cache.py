"""The paged KV cache (vLLM-style blocks): the founding design, seed/paged_kv_cache.py.

The analogy is virtual memory:
    block table = page table (one per sequence: logical block j -> physical block)
    block       = page (block_size tokens of K and V, every layer)
    token t     = (table[t // block_size], t % block_size)

All layers share one block table. Blocks are allocated as a sequence grows, all the same size,
so a freed block fits any sequence: no external fragmentation, and at most block_size - 1
wasted slots per sequence. Padding from the batched prefill is never stored.

When a decode step needs more blocks than are free, the newest sequence is preempted: its
blocks are freed and the engine recomputes it later (prompt + tokens so far), vLLM's default
recompute policy.

Differences from the seed: positions are real token positions (no RoPE offset for padding),
and a decode step runs only the active slots, so an idle slot costs nothing.
"""

import math

import torch
from torch import Tensor

from tinyllm.engine.kv_cache import DecodeSlots, LayerKV


class OutOfBlocks(RuntimeError):
    pass


class BlockAllocator:
    """Fixed-size blocks with a free list. Lowest ids are handed out first (reused LIFO)."""

    def __init__(self, n_blocks: int, block_size: int):
        self.n_blocks, self.block_size = n_blocks, block_size
        self._free = list(range(n_blocks - 1, -1, -1))  # stack: pop() gives block 0 first
        self._in_use = [False] * n_blocks
        self.peak_used = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.n_blocks - len(self._free)

    def alloc(self) -> int:
        if not self._free:
            raise OutOfBlocks(f"all {self.n_blocks} KV blocks in use")
        b = self._free.pop()
        self._in_use[b] = True
        self.peak_used = max(self.peak_used, self.num_used)
        return b

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if not self._in_use[b]:
                raise ValueError(f"block {b} freed twice (or never allocated)")
            self._in_use[b] = False
            self._free.append(b)


class PagedKVCache(DecodeSlots):
    """n_slots sequence slots over a shared pool of n_blocks KV blocks."""

    def __init__(
        self,
        n_layers: int,
        n_slots: int,
        n_kv_heads: int,
        head_dim: int,
        n_blocks: int,
        block_size: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        super().__init__(n_slots, max_len)
        self.alloc = BlockAllocator(n_blocks, block_size)
        self.bs = block_size
        self.max_blocks = math.ceil(max_len / block_size)
        self.scratch = n_blocks  # extra block, never allocated: unused table entries point here
        # Token-major blocks (block, slot, head, dim): one token's keys are contiguous, so a
        # write is one index_copy_ and a gathered table is a (rows, tokens, H, D) view.
        shape = (n_blocks + 1, block_size, n_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        # CPU bookkeeping (scheduling, no device syncs) and its device mirror (indexing, masks).
        self.tables: list[list[int]] = [[] for _ in range(n_slots)]
        self._admit_no = [0] * n_slots  # admission order, for picking preemption victims
        self._admits = 0
        self._table_dev = torch.full(
            (n_slots, self.max_blocks), self.scratch, dtype=torch.long, device=device
        )
        self._write_at = self._table_step = None
        self._gather: list[Tensor | None] = [None, None]

    # -- scheduling --------------------------------------------------------

    def _blocks_for(self, n_tokens: int) -> int:
        return math.ceil(n_tokens / self.bs)

    def fits_ever(self, length: int) -> bool:
        """Could a prompt of this length run at all, with the whole pool to itself?"""
        return length < self.max_len and self._blocks_for(length + 1) <= self.alloc.n_blocks

    def can_admit(self, lengths: list[int]) -> bool:
        """Enough free blocks for these prompts, plus room for each one's first decode token."""
        need = sum(self._blocks_for(n + 1) for n in lengths)
        return len(lengths) <= len(self.free_slots()) and need <= self.alloc.num_free

    def admit(self, slots: list[int], prefill) -> None:
        """Copy prefill sequence j (its `spans()[j]`, real tokens only) into fresh blocks for
        slots[j]."""
        dev = self._table_dev.device
        src, dst = [], []
        for s, (start, n) in zip(slots, prefill.spans(), strict=True):
            if n >= self.max_len:
                raise ValueError(f"prompt length {n} >= max_len {self.max_len}")
            blocks = [self.alloc.alloc() for _ in range(self._blocks_for(n))]
            self.tables[s] = blocks
            self.lens[s], self.active[s] = n, True
            self._admits += 1
            self._admit_no[s] = self._admits
            self._table_dev[s].fill_(self.scratch)
            self._table_dev[s, : len(blocks)] = torch.tensor(blocks, device=dev)
            t = torch.arange(n)
            src.append(start + t)
            dst.append(torch.tensor(blocks, dtype=torch.long)[t // self.bs] * self.bs + t % self.bs)
        src, dst = torch.cat(src).to(dev), torch.cat(dst).to(dev)
        for i in range(len(self.k)):
            for pool, tokens in zip((self.k[i], self.v[i]), prefill.token_major(i), strict=True):
                pool.view(-1, *pool.shape[2:]).index_copy_(0, dst, tokens.index_select(0, src))

    def release(self, slot: int) -> None:
        self.alloc.free(self.tables[slot])
        self.tables[slot] = []
        self.active[slot] = False
        self.lens[slot] = 0
        self._table_dev[slot].fill_(self.scratch)

    def _needs_block(self, s: int) -> bool:
        return self.active[s] and len(self.tables[s]) * self.bs <= self.lens[s]

    def reserve_step(self) -> list[int]:
        """Make sure the next decode step's new blocks can be allocated.

        Preempts the newest sequences (frees their blocks) until they can; returns the
        preempted slots, newest first."""
        victims = []
        while any(self.active):
            need = sum(map(self._needs_block, range(self.n_slots)))
            if need <= self.alloc.num_free:
                break
            v = max(self.active_slots(), key=self._admit_no.__getitem__)
            self.release(v)
            victims.append(v)
        return victims

    def allocated_tokens(self) -> int:
        return self.alloc.num_used * self.bs

    def reserved_tokens(self) -> int:
        """Pool capacity: the KV memory this cache holds."""
        return self.alloc.n_blocks * self.bs

    # -- model protocol (decode: one token per active slot) -----------------

    def begin_step(self, T: int, rope) -> tuple[Tensor, Tensor]:
        rows, lens = self._decode_rows(T)
        dev = self._table_dev.device
        grow = [s for s in rows if self._needs_block(s)]
        for s in grow:
            self.tables[s].append(self.alloc.alloc())  # reserve_step made room
        if grow:
            cols = [len(self.tables[s]) - 1 for s in grow]
            new = [self.tables[s][-1] for s in grow]
            self._table_dev[torch.tensor(grow, device=dev), torch.tensor(cols, device=dev)] = (
                torch.tensor(new, device=dev)
            )
        n_read = self._blocks_for(max(lens) + 1)
        cos_sin = self._decode_positions(lens, n_read * self.bs, rope)
        self._table_step = self._table_dev[torch.tensor(rows, device=dev), :n_read]  # (R, n_read)
        at = self._table_step[torch.arange(len(rows), device=dev), self._lens_dev // self.bs]
        self._write_at = at * self.bs + self._lens_dev % self.bs  # flat token index in the pool
        return cos_sin

    def gather_buffer(self, which: int, n_blocks: int) -> Tensor:
        """Reused storage for one step's gathered K (0) or V (1) blocks. Each layer's copy is
        read by its attention before the next layer's overwrites it; a fresh tensor per layer
        costs a page fault per touched page (measured: 1.5 s vs 0.65 s per step at 64 x 512)."""
        buf = self._gather[which]
        if buf is None or buf.shape[0] < n_blocks:
            shape = (max(n_blocks, 2 * (0 if buf is None else buf.shape[0])), *self.k[0].shape[1:])
            buf = self._gather[which] = torch.empty(
                shape, dtype=self.k[0].dtype, device=self.k[0].device
            )
        return buf[:n_blocks]

    def layer(self, i: int) -> "PagedLayerKV":
        return PagedLayerKV(self, i)


class PagedLayerKV(LayerKV):
    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """k, v (R, H, 1, D): write each row's token into its block, then gather its blocks."""
        c = self.cache
        table = c._table_step.reshape(-1)
        R = c._table_step.shape[0]

        def write_and_gather(pool: Tensor, new: Tensor, which: int) -> Tensor:
            _, bs, H, D = pool.shape
            pool.view(-1, H, D).index_copy_(0, c._write_at, new[:, :, 0])
            # index_select, not pool[table]: 2-D advanced indexing is ~1000x slower on CPU.
            out = c.gather_buffer(which, table.numel())
            torch.index_select(pool, 0, table, out=out)
            return out.view(R, -1, H, D).transpose(1, 2)

        return write_and_gather(c.k[self.i], k, 0), write_and_gather(c.v[self.i], v, 1)
