"""The KV block pool: reference counts, and the prefix cache's hash -> block map and eviction order.

A block is in exactly one of three places: held (reference count >= 1, by one request or shared
by several), free and plain (it holds nothing worth keeping), or free and cached (it holds the
K/V of a full block that some request computed, findable by its hash until it is evicted).

Allocation order:
- Plain free blocks first, lowest id first, reused last in, first out (the most recently used
  block is the likeliest to be warm in the CPU's caches).
- Then cached blocks are evicted, least recently used first: a block whose last reference went
  away longest ago is the least likely to be asked for again (a chat's next turn, a system prompt
  that is still in use come back soon). Blocks released together (one request's blocks, freed
  at once) are equally recent; among those the deepest in its chain goes first, because a block
  is only found through its parents: evicting a parent strands its children, evicting a leaf
  keeps the rest of the chain matchable.
Plain blocks go first because they hold nothing; a cached one is given up only when none is left.

A cached block is read-only: it is full, and only blocks a single request owns that are not yet
full are ever written (the manager's job). Eviction never touches a held block: only blocks
with a reference count of 0 are in the eviction queue.
"""

from collections import Counter, OrderedDict

# What identifies a full block's content: (parent block's hash, its token ids, extra key). The
# extra key is whatever else changes its K/V (the model and its weight format and dtype).
BlockKey = tuple[int | None, tuple[int, ...], object]


def block_key(parent: int | None, token_ids: list[int], extra: object) -> BlockKey:
    return parent, tuple(token_ids), extra


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._plain = list(range(num_blocks - 1, -1, -1))  # a stack: pop() gives block 0 first
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, ref 0: evict from front
        # The map is keyed by the whole key, so dict equality checks a hit's token ids exactly;
        # only the link to the parent is a 64-bit hash.
        self._cached: dict[BlockKey, int] = {}
        self.block_key: list[BlockKey | None] = [None] * num_blocks
        self.ref_cnt = [0] * num_blocks
        self.peak_used = 0
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: plain free ones and cached ones no request holds."""
        return len(self._plain) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks findable by hash, held or not."""
        return len(self._cached)

    def is_evictable(self, block: int) -> bool:
        return block in self._evictable

    def lookup(self, key: BlockKey) -> int | None:
        return self._cached.get(key)

    def allocate(self, n: int) -> list[int]:
        """n blocks for one request to write, each with a reference count of 1."""
        if n > self.num_free:
            raise ValueError(f"asked for {n} KV blocks, {self.num_free} of {self.num_blocks} free")
        blocks = [self._take() for _ in range(n)]
        for b in blocks:
            self.ref_cnt[b] = 1
        self._note_peak()
        return blocks

    def _take(self) -> int:
        if self._plain:
            return self._plain.pop()
        b, _ = self._evictable.popitem(last=False)
        del self._cached[self.block_key[b]]
        self.block_key[b] = None
        self.num_evictions += 1
        return b

    def touch(self, blocks: list[int]) -> None:
        """Share cached blocks with one more request: a block no one held leaves the queue."""
        for b in blocks:
            if self.ref_cnt[b] == 0:
                del self._evictable[b]
            self.ref_cnt[b] += 1
        self._note_peak()

    def cache(self, block: int, key: BlockKey) -> bool:
        """Make a full, held block findable by its key. False (and nothing changes) if another
        block already holds that content (two requests computed it at once): that one is kept
        and this one stays plain, freed as any other."""
        if not self.enable_caching or key in self._cached:
            return False
        self._cached[key] = block
        self.block_key[block] = key
        return True

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block. Pass a request's blocks in chain order: the ones
        that become free enter the eviction queue deepest first (see the module docstring)."""
        for b, n in Counter(blocks).items():  # check all first: a bad list frees nothing
            if not 0 <= b < self.num_blocks:
                raise ValueError(f"block {b} is not in the pool of {self.num_blocks}")
            if self.ref_cnt[b] < n:
                raise ValueError(f"block {b} freed twice (or never allocated)")
        for b in reversed(blocks):
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                if self.block_key[b] is None:
                    self._plain.append(b)
                else:
                    self._evictable[b] = None

    def reset_cache(self) -> int:
        """Forget every cached block: free ones become plain, held ones stay with their
        requests but can no longer be matched. Returns how many blocks were forgotten."""
        n = len(self._cached)
        for b in self._cached.values():
            self.block_key[b] = None
        self._plain += sorted(self._evictable, reverse=True)  # lowest id on top, as at start
        self._evictable.clear()
        self._cached.clear()
        return n

    def _note_peak(self) -> None:
        self.peak_used = max(self.peak_used, self.num_used)
