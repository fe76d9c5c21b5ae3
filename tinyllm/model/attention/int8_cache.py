"""The int8 K/V cache (kv_cache_dtype="int8"): half a bf16 cache's bytes, a quarter of fp32's.

A cache row (one token, one KV head) is head_dim int8 codes followed by the 4 bytes of the fp32
scale they are multiplied by, so the caches stay one int8 tensor each, (num_blocks + 1,
block_size, kv_heads, head_dim + 4), and travel as the other caches do. The scale is per token
and head, symmetric: the row's largest magnitude over 127. A token's codes then depend on its
own K/V alone, not on what shares its block or step, so it keeps its bits batched or alone, and
a block written in one step reads the same later. The CPU kernel (cpu_kernel.cpp's
quantize_row and to_floats) does the same arithmetic in C++, bit for bit.
"""

import torch
from torch import Tensor

from tinyllm.model.choices import KV_CACHE_DTYPES

SCALE_BYTES = 4  # an fp32 scale after each row's codes


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r}: choose one of {', '.join(KV_CACHE_DTYPES)}"
        )
    return torch.int8 if kv_cache_dtype == "int8" else model_dtype


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """A cache row's last dimension: head_dim values, or codes and their scale's bytes."""
    return head_dim + SCALE_BYTES if dtype == torch.int8 else head_dim


def quantize(x: Tensor) -> Tensor:
    """(..., D) values of any float dtype -> (..., D + 4) int8 rows: each row's codes
    round(x / scale) (ties to even), scale = max |x| / 127 in fp32 (0 for a row of zeros)."""
    x = x.float()
    scale = x.abs().amax(-1, keepdim=True) / 127
    codes = torch.where(scale > 0, x / scale, 0).round().clamp(-127, 127).to(torch.int8)
    return torch.cat([codes, scale.view(torch.int8)], dim=-1)


def dequantize(rows: Tensor, dtype: torch.dtype) -> Tensor:
    """(..., D + 4) int8 rows -> (..., D) values: codes times scale in fp32, then `dtype`. The
    scales are cloned to a fresh tensor, where their bytes can be viewed as fp32 at any D."""
    codes, scale = (
        rows[..., :-SCALE_BYTES],
        rows[..., -SCALE_BYTES:].clone(memory_format=torch.contiguous_format),
    )
    return (codes.float() * scale.view(torch.float32)).to(dtype)
