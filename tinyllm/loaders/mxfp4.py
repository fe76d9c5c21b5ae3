"""MXFP4 weights (the OCP Microscaling format, gpt-oss's experts): blocks of 32 FP4 (E2M1)
values sharing one E8M0 scale, w = e2m1 * 2^(scale - 127). Each value times 2 is an integer in
[-12, 12], so a block is exactly an 8-bit group of model/quant.py's format: codes u = 2 e2m1 + 128,
d = 2^(scale - 128) and m = -128 d. Those run on the int8 kernel bit for bit as stored (d and m
are fp16 there: exact for scales 104..136, which is where trained weights sit; blocks outside it
are refused), or dequantize exactly to bf16 or fp32.
"""

import torch
from torch import Tensor

from tinyllm.model.config import ModelLoadError
from tinyllm.model.quant import GROUP, GroupQuantized

# The 16 E2M1 codes times 2 (OCP MX spec v1.0, table 5: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their
# negatives; code 8 is -0).
E2M1_TIMES_2 = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12])
# The E8M0 scales whose d = 2^(s - 128) and m = -2^(s - 121) fp16 holds exactly.
EXACT_SCALES = range(104, 137)


def mxfp4_groups(codes: Tensor, scales: Tensor) -> GroupQuantized:
    """A weight of N rows stored as MXFP4, its E2M1 `codes` (N, K) (0..15, unpacked from the
    file's nibbles: hf_codes, loaders/gguf_blocks.py) and E8M0 `scales` (N, K / 32) uint8, as
    8-bit groups (see the module docstring). A block whose values are all zero may have any
    scale."""
    n, k = codes.shape
    if k % GROUP or scales.shape != (n, k // GROUP):
        raise ModelLoadError(
            f"MXFP4 codes {tuple(codes.shape)} and scales {tuple(scales.shape)} must be "
            f"(rows, groups * {GROUP}) and (rows, groups)"
        )
    codes = codes.long()
    q = (E2M1_TIMES_2[codes] + 128).to(torch.uint8)
    s = scales.int()
    used = (codes & 7).view(n, -1, GROUP).any(-1)  # a block of zeros (either sign): no scale
    bad = used & ((s < EXACT_SCALES.start) | (s >= EXACT_SCALES.stop))
    if bad.any():
        raise ModelLoadError(
            f"MXFP4 scale {int(s[bad][0])} (2^{int(s[bad][0]) - 127}) is outside "
            f"{EXACT_SCALES.start}..{EXACT_SCALES.stop - 1}, which 8-bit groups hold exactly"
        )
    d = torch.ldexp(torch.ones(s.shape), s - 128).masked_fill_(~used, 0)
    return GroupQuantized(q, d, -128 * d, bits=8)


def hf_codes(blocks: Tensor) -> Tensor:
    """Hugging Face's MXFP4 `*_blocks` (N, K / 32, 16) uint8 as codes (N, K): each byte two
    consecutive values, the low nibble first."""
    if blocks.dtype != torch.uint8 or blocks.shape[-1] != GROUP // 2:
        raise ModelLoadError(
            f"MXFP4 blocks {tuple(blocks.shape)} of {blocks.dtype} must be uint8 (rows, groups, "
            f"{GROUP // 2})"
        )
    return torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(1)
