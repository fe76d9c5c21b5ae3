"""The interface every attention backend implements, and the per-step metadata it reads."""

from dataclasses import dataclass

import torch
from torch import Tensor

from tinyllm.model.attention.int8_cache import quantize


@dataclass
class AttentionMetadata:
    """One step's batch layout, built once per step by the model runner, read by every layer."""

    slot_mapping: Tensor  # (N,) long: flat pool slot (block * block_size + offset) per new token
    block_tables: Tensor  # (R, max_blocks) long: each row's blocks, padded with the scratch block
    seq_lens: Tensor  # (R,) long: tokens of context per row once this step's are written
    query_start_loc: Tensor  # (R + 1,) long: row r's new tokens are [start[r], start[r + 1])
    num_decodes: int  # rows [0, num_decodes) have exactly one new token each
    # The same numbers on the CPU, for backends that loop over rows in Python.
    seq_lens_cpu: list[int]
    query_lens_cpu: list[int]

    @property
    def num_rows(self) -> int:
        return len(self.seq_lens_cpu)


class AttentionBackend:
    """Writes the step's new K/V into the cache (`write`), then attends (`attend`).

    Subclasses implement `attend`. Shapes: q (N, Hq, D), k/v (N, Hkv, D) with Hq a multiple of
    Hkv (grouped-query attention); caches (num_blocks + 1, block_size, Hkv, D) of q's dtype, or
    int8 ones of codes and scales (attention/int8_cache.py). `window`: a
    layer's sliding window (ModelConfig.sliding_window), None for the whole context. `softcap`:
    each scaled score s becomes softcap * tanh(s / softcap) before the softmax (Gemma 2's
    attn_logit_softcapping), None: as it is. `sinks`: (Hq,) a logit per query head that joins
    each softmax's denominator and contributes no value (gpt-oss's attention sinks), None: none."""

    name = "base"
    supports_sliding_window = True  # whether `attend` honours a window (get_backend checks)
    supports_int8_cache = True  # whether it reads int8 caches (the model runner checks)

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
        sinks: Tensor | None = None,
    ) -> Tensor:
        self.write(k, v, k_cache, v_cache, meta)
        return self.attend(q, k, v, k_cache, v_cache, meta, scale, window, softcap, sinks)

    @staticmethod
    def write(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata):
        """Store each new token's K and V at its slot (quantized first for an int8 cache): one
        index_copy_ per tensor."""
        if k_cache.dtype == torch.int8:
            k, v = quantize(k), quantize(v)
        H, D = k_cache.shape[2:]
        k_cache.view(-1, H, D).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, H, D).index_copy_(0, meta.slot_mapping, v)

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
        sinks: Tensor | None = None,
    ) -> Tensor:
        """Attention output (N, Hq, D). The new tokens' K/V are already in the cache; `k` and
        `v` are passed too, for rows whose whole context is new (a first prefill chunk). With
        `window`, the query at position p attends to positions max(0, p - window + 1)..p."""
        raise NotImplementedError


@dataclass
class ForwardContext:
    """What a forward pass needs besides token ids and positions: the step's metadata, the
    backend and each layer's (K, V) cache. The model runner owns the caches and builds this."""

    meta: AttentionMetadata
    backend: AttentionBackend
    kv_caches: list[tuple[Tensor, Tensor]]
