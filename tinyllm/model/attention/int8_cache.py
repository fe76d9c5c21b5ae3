"""The int8 K/V cache (kv_cache_dtype="int8"): about half a bf16 cache's bytes, a quarter of
fp32's.

A cache row (one token, one KV head) is head_dim int8 codes followed by one fp32 scale per group
of 32 of them (the last group possibly shorter), 72 bytes for a head of 64 where bf16 takes 128.
So the caches stay one int8 tensor each, (num_blocks + 1, block_size, kv_heads, row_width), and
travel as the other caches do. Each scale is symmetric: its group's largest magnitude over 127.
A token's codes then depend on its own K/V alone, not on what shares its block or step, so it
keeps its bits batched or alone, and a block written in one step reads the same later (scales
per block or per channel would not). Groups of 32 rather than one scale per head: a key's few
large channels then coarsen only their own group, and fp32 scales, not bf16 ones, whose rounding
down clips each group's largest value (docs/MEASUREMENTS.md, "The int8 KV cache").
The CPU kernel (cpu_kernel.cpp's quantize_row and to_floats, cpu_ops.h's layout) does the same
arithmetic in C++, bit for bit.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from tinyllm.model.choices import KV_CACHE_DTYPES

GROUP = 32  # codes per scale
SCALE_BYTES = 4  # an fp32 scale


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r}: choose one of {', '.join(KV_CACHE_DTYPES)}"
        )
    return torch.int8 if kv_cache_dtype == "int8" else model_dtype


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """A cache row's last dimension: head_dim values, or codes and their scales' bytes."""
    if dtype != torch.int8:
        return head_dim
    return head_dim + SCALE_BYTES * -(-head_dim // GROUP)


def quantize(x: Tensor) -> Tensor:
    """(..., D) values of any float dtype -> (..., row_width) int8 rows: each group's codes
    round(x / scale) (ties to even), scale = max |x| / 127 in fp32 (0: codes 0)."""
    D = x.shape[-1]
    groups = -(-D // GROUP)
    x = F.pad(x.float(), (0, groups * GROUP - D)).unflatten(-1, (groups, GROUP))
    scale = x.abs().amax(-1, keepdim=True) / 127
    codes = torch.where(scale > 0, x / scale, 0).round().clamp(-127, 127).to(torch.int8)
    codes = codes.flatten(-2)[..., :D]
    return torch.cat([codes, scale.flatten(-2).view(torch.int8)], dim=-1)


def dequantize(rows: Tensor, dtype: torch.dtype) -> Tensor:
    """(..., row_width) int8 rows -> (..., D) values: codes times their scale in fp32, then
    `dtype`. The scales are copied to a fresh tensor, where their bytes view as fp32 at any D."""
    width = rows.shape[-1]
    groups = -(-width // (GROUP + SCALE_BYTES))  # row_width grows with D: this inverts it
    D = width - SCALE_BYTES * groups
    codes = F.pad(rows[..., :D].float(), (0, groups * GROUP - D)).unflatten(-1, (groups, GROUP))
    scale = rows[..., D:].clone(memory_format=torch.contiguous_format).view(torch.float32)
    return (codes * scale[..., None]).flatten(-2)[..., :D].to(dtype)
