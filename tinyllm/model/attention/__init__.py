"""Attention backends: how one layer writes its new K/V into the paged cache and attends.

The model runner lays one step's batch out flat: every scheduled request contributes its new
tokens (one for a decode, a chunk of its prompt for a prefill), decode rows first. A layer's
cache is a pool of fixed-size blocks, token-major `(num_blocks + 1, block_size, kv_heads,
head_dim)`; the last block is scratch, which padded block-table entries point to.

Row r's new tokens are `q[query_start_loc[r]:query_start_loc[r + 1]]`; they sit at the last
positions of its context of `seq_lens[r]` tokens, so new token i of a row with `n` new tokens
attends causally to context positions `[0, seq_lens[r] - n + i]`.

The pool is never zeroed: a slot at or past a row's `seq_lens[r]` (the tail of its last block,
the scratch block) holds whatever bits were there, NaN included, or an earlier request's K/V.
No backend lets such a slot reach the output: the CPU and CUDA kernels never read past a row's
length, and the reference zeroes what it gathered there (masking the scores alone is not
enough: a weight of 0 times a NaN value is NaN).
"""

from tinyllm.model.attention.backend import AttentionBackend, AttentionMetadata, ForwardContext
from tinyllm.model.attention.select import BACKENDS, get_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "ForwardContext", "BACKENDS", "get_backend"]
