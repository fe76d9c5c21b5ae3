"""Contiguous KV caches: the prefill caches and the slot cache (the baseline the paged cache beats).

Every cache's layer view stores new keys/values and attends over what the sequence may see:
`layer(i).attention(q, k, v)`. The default is SDPA over `update(k, v)` with `attn_kwargs`; a
cache that knows a cheaper way (PackedKVCache: one causal SDPA per prompt) overrides it.

Positions are real token positions (a left-padded prompt's first real token is position 0), the
same as the reference implementation's position_ids, so batching never shifts RoPE.
"""

import torch
import torch.nn.functional as F
from torch import Tensor


class LayerKV:
    """One layer's view of a cache; subclasses say how to store and what to read."""

    def __init__(self, cache, i: int):
        self.cache, self.i = cache, i

    @property
    def attn_kwargs(self) -> dict:
        return self.cache.attn_kwargs

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def attention(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q (B, Hq, T, D), new k/v (B, H, T, D) -> attention output (B, Hq, T, D)."""
        k, v = self.update(k, v)
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **self.attn_kwargs)


class KVCache:
    """A batch of left-padded prompts, prefilled (and optionally decoded) together.

    `k[i]`, `v[i]` are (B, H, max_len, D); `pos` is how many columns are filled. Row b has
    `pad_lens[b]` padding columns on the left, which attention masks out.
    """

    def __init__(
        self,
        n_layers: int,
        pad_lens: list[int],
        n_kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        B = len(pad_lens)
        shape = (B, n_kv_heads, max_len, head_dim)
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.max_len, self.pos = max_len, 0
        self.pad = torch.tensor(pad_lens, device=device)
        self.attn_kwargs: dict = {}

    def begin_step(self, T: int, rope) -> tuple[Tensor, Tensor]:
        if self.pos + T > self.max_len:
            raise ValueError(f"{self.pos + T} tokens exceed this cache's max_len {self.max_len}")
        dev = self.pad.device
        q_col = torch.arange(self.pos, self.pos + T, device=dev)
        if self.pos == 0 and not self.pad.any():
            self.attn_kwargs = {"is_causal": True}
        else:
            k_col = torch.arange(self.pos + T, device=dev)
            real = k_col[None, :] >= self.pad[:, None]  # (B, S)
            causal = k_col[None, :] <= q_col[:, None]  # (T, S)
            # A padding query attends to itself only, so its softmax row is never empty (NaN).
            mask = (real[:, None, :] & causal) | (k_col == q_col[:, None])
            self.attn_kwargs = {"attn_mask": mask[:, None]}
        return rope.at((q_col[None, :] - self.pad[:, None]).clamp(min=0))

    def layer(self, i: int) -> "_ContiguousLayerKV":
        return _ContiguousLayerKV(self, i)

    def end_step(self, T: int) -> None:
        self.pos += T

    def spans(self) -> list[tuple[int, int]]:
        """Each row's real tokens as (start, length) in `token_major` order."""
        return [(j * self.max_len + p, self.pos - p) for j, p in enumerate(self.pad.tolist())]

    def token_major(self, i: int) -> tuple[Tensor, Tensor]:
        """Layer i's K and V as (B*max_len, H, D), rows one after another, for admit()."""
        return tuple(
            t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3]) for t in (self.k[i], self.v[i])
        )


class _ContiguousLayerKV(LayerKV):
    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        c, i, T = self.cache, self.i, k.shape[2]
        c.k[i][:, :, c.pos : c.pos + T] = k
        c.v[i][:, :, c.pos : c.pos + T] = v
        return c.k[i][:, :, : c.pos + T], c.v[i][:, :, : c.pos + T]


class PackedKVCache:
    """Prompts packed end to end in one row for a single prefill step: no padding computed.

    The linear layers see one (1, N) batch of every prompt's tokens; attention runs causally
    within each prompt, one SDPA call per prompt, so no token looks across a boundary and no
    compute goes to an N x N mask. Positions restart at 0 for every prompt.
    """

    def __init__(
        self,
        n_layers: int,
        lengths: list[int],
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        self.lengths, N = lengths, sum(lengths)
        self.starts = [0]
        for n in lengths[:-1]:
            self.starts.append(self.starts[-1] + n)
        # Stored token-major (N, H, D), the layout admit() copies from: no second transpose.
        shape = (N, n_kv_heads, head_dim)
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.positions = torch.cat([torch.arange(n, device=device) for n in lengths])[None]
        self.attn_kwargs: dict = {}

    def begin_step(self, T: int, rope) -> tuple[Tensor, Tensor]:
        if T != self.positions.shape[1]:
            raise ValueError(f"a packed prefill runs all {self.positions.shape[1]} tokens at once")
        return rope.at(self.positions)

    def layer(self, i: int) -> "_PackedLayerKV":
        return _PackedLayerKV(self, i)

    def end_step(self, T: int) -> None:
        pass

    def spans(self) -> list[tuple[int, int]]:
        return list(zip(self.starts, self.lengths, strict=True))

    def last_token_index(self) -> list[int]:
        return [s + n - 1 for s, n in self.spans()]

    def token_major(self, i: int) -> tuple[Tensor, Tensor]:
        return self.k[i], self.v[i]


class _PackedLayerKV(LayerKV):
    def attention(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        c = self.cache
        c.k[self.i].copy_(k[0].transpose(0, 1))
        c.v[self.i].copy_(v[0].transpose(0, 1))
        out = torch.empty_like(q)
        for s, n in c.spans():
            out[:, :, s : s + n] = F.scaled_dot_product_attention(
                q[:, :, s : s + n],
                k[:, :, s : s + n],
                v[:, :, s : s + n],
                is_causal=True,
                enable_gqa=True,
            )
        return out


class DecodeSlots:
    """What the slot and paged caches share: n_slots sequence slots decoded one token each.

    CPU bookkeeping (`lens`, `active`) drives scheduling without device syncs; each decode step
    mirrors the active rows' lengths to the device for positions and the length mask.
    """

    def __init__(self, n_slots: int, max_len: int):
        self.n_slots, self.max_len = n_slots, max_len
        self.lens = [0] * n_slots  # tokens stored
        self.active = [False] * n_slots
        self.attn_kwargs: dict = {}
        self._lens_dev: Tensor | None = None
        self.k: list[Tensor] = []
        self.v: list[Tensor] = []

    def free_slots(self) -> list[int]:
        return [s for s in range(self.n_slots) if not self.active[s]]

    def active_slots(self) -> list[int]:
        return [s for s in range(self.n_slots) if self.active[s]]

    def used_tokens(self) -> int:
        return sum(n for n, a in zip(self.lens, self.active, strict=True) if a)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def _decode_rows(self, T: int) -> tuple[list[int], list[int]]:
        """The active slots and their lengths for a one-token decode step."""
        if T != 1:
            name = type(self).__name__
            raise ValueError(f"{name} decodes one token per slot; prefill goes through KVCache")
        rows = self.active_slots()
        lens = [self.lens[s] for s in rows]
        if max(lens) >= self.max_len:
            raise ValueError(f"a sequence is full (max_len {self.max_len})")
        return rows, lens

    def _decode_positions(self, lens: list[int], n_keys: int, rope) -> tuple[Tensor, Tensor]:
        """Mask keys past each row's length; the new token sits at position len."""
        dev = self.k[0].device
        self._lens_dev = torch.tensor(lens, device=dev)
        k_pos = torch.arange(n_keys, device=dev)
        self.attn_kwargs = {"attn_mask": (k_pos <= self._lens_dev[:, None])[:, None, None, :]}
        return rope.at(self._lens_dev[:, None])

    def end_step(self, T: int) -> None:
        for s in self.active_slots():
            self.lens[s] += 1


class SlotKVCache(DecodeSlots):
    """S slots, each reserving max_len tokens up front: simple, and wasteful by design.

    Same scheduling calls as PagedKVCache (free_slots / can_admit / admit / release /
    reserve_step) and the same model protocol, decoding one token for every active slot.
    """

    def __init__(
        self,
        n_layers: int,
        n_slots: int,
        n_kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        super().__init__(n_slots, max_len)
        shape = (n_slots, n_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self._rows: Tensor | slice = slice(0, 0)
        self._row_idx: Tensor | None = None

    # -- scheduling --------------------------------------------------------

    def fits_ever(self, length: int) -> bool:
        return length < self.max_len

    def can_admit(self, lengths: list[int]) -> bool:
        return len(lengths) <= len(self.free_slots()) and all(map(self.fits_ever, lengths))

    def admit(self, slots: list[int], prefill) -> None:
        """Copy prefill sequence j (its `spans()[j]`, real tokens only) into slots[j]."""
        spans = prefill.spans()
        for _, n in spans:
            if not self.fits_ever(n):
                raise ValueError(f"prompt length {n} >= max_len {self.max_len}")
        for i in range(len(self.k)):
            for pool, src in zip((self.k[i], self.v[i]), prefill.token_major(i), strict=True):
                for s, (start, n) in zip(slots, spans, strict=True):
                    pool[s, :, :n] = src[start : start + n].transpose(0, 1)
        for s, (_, n) in zip(slots, spans, strict=True):
            self.lens[s], self.active[s] = n, True

    def release(self, slot: int) -> None:
        self.lens[slot], self.active[slot] = 0, False

    def reserve_step(self) -> list[int]:
        """Every slot already owns max_len tokens, so a step never needs to preempt."""
        return []

    def allocated_tokens(self) -> int:
        return sum(self.active) * self.max_len

    def reserved_tokens(self) -> int:
        return self.n_slots * self.max_len

    # -- model protocol (decode: one token per active slot) -----------------

    def begin_step(self, T: int, rope) -> tuple[Tensor, Tensor]:
        rows, lens = self._decode_rows(T)
        # Slots are handed out lowest first, so the active ones are usually a prefix: a slice
        # reads them without copying.
        contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
        dev = self.k[0].device
        self._rows = slice(rows[0], rows[-1] + 1) if contiguous else torch.tensor(rows, device=dev)
        self._n_read = max(lens) + 1
        self._row_idx = torch.arange(len(rows), device=dev)
        return self._decode_positions(lens, self._n_read, rope)

    def layer(self, i: int) -> "_SlotLayerKV":
        return _SlotLayerKV(self, i)


class _SlotLayerKV(LayerKV):
    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        c, i, n = self.cache, self.i, self.cache._n_read
        out = []
        for pool, new in ((c.k[i], k), (c.v[i], v)):
            if isinstance(c._rows, slice):  # a view: write through it, read without a copy
                rows = pool[c._rows]
                rows[c._row_idx, :, c._lens_dev] = new[:, :, 0]
                out.append(rows[:, :, :n])
            else:  # scattered slots: write in place, copy only the columns attention reads
                pool[c._rows, :, c._lens_dev] = new[:, :, 0]
                out.append(pool[c._rows, :, :n])
        return out[0], out[1]
