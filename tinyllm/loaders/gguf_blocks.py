"""GGUF's quantized blocks as the kernel's groups of 32 (model/quant.py: w = d * u + m, fp16 d
and m, unsigned codes u), read from the file's bytes without a dense copy of the weight.

Every type here is, per sub-block of 32 weights, codes u and a scale d and offset m with
w = d * u + m; the K-quants (super-blocks of 256) compute d = d_super * sc and m = -dmin * mn
from 6-bit sub-scales. So:
- 4-bit codes (Q4_0, Q4_1, Q4_K) are 4-bit groups as they are; Q4_K's d * sc and dmin * mn
  are rounded to the fp16 the kernel stores (at most 2^-11 of each, relative);
- 5- and 8-bit codes (Q5_0, Q5_1, Q5_K, Q8_0) are 8-bit groups, the codes shifted so none is 0
  (pack says why): by 112 for Q5_0 (m = -16d becomes -128d, exact), by 1 for Q5_1 and Q5_K,
  whose m - d is then rounded to fp16.
MXFP4 (gpt-oss's experts) is 8-bit groups exactly (loaders/mxfp4.py).
Q2_K, Q3_K and Q6_K have sub-blocks of 16, two scales in one of the kernel's groups: their
weights are dequantized and rounded again (model/quant.py's int4_groups or int8_groups).
docs/MEASUREMENTS.md, "GGUF block types", gives what each choice costs.
"""

import warnings

import gguf
import numpy as np
import torch

from tinyllm.loaders.mxfp4 import mxfp4_groups
from tinyllm.model.quant import GroupQuantized, int4_groups, int8_groups

Q = gguf.GGMLQuantizationType

# Shift of each 8-bit type's codes, so that no code is 0 (see the module docstring).
SHIFT_8BIT = {Q.Q8_0: 0, Q.Q5_0: 112, Q.Q5_1: 1, Q.Q5_K: 1}
GROUP_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q4_K, *SHIFT_8BIT)  # packed as stored
# The bits the kernel runs each type in: 2- to 4-bit types in 4-bit groups, 5- to 8-bit ones
# in 8-bit groups.
KERNEL_BITS = {
    **dict.fromkeys((Q.Q4_0, Q.Q4_1, Q.Q2_K, Q.Q3_K, Q.Q4_K), 4),
    **dict.fromkeys((Q.Q5_0, Q.Q5_1, Q.Q5_K, Q.Q6_K, Q.Q8_0, Q.MXFP4), 8),
}
FP16_MAX = float(np.finfo(np.float16).max)  # the kernel stores d and m in fp16


def _fresh(shape: tuple[int, ...]) -> np.ndarray:
    """An uninitialized uint8 array from torch's allocator: its fresh pages fault in faster
    than numpy's, and the codes are most of the memory a load writes."""
    return torch.empty(shape, dtype=torch.uint8).numpy()


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 field at byte `at` of every block, as float32 (n_blocks, 1)."""
    return blocks[:, at : at + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(n, c, 32) bytes -> (n, c, 2, 32): the low nibbles' 32 weights, then the high ones'.
    Written into one array with no temporaries, by torch on all its threads (numpy's runs on
    one): this is most of a Q4 file's load."""
    with warnings.catch_warnings():  # the file's map is read-only, and only read here
        warnings.filterwarnings("ignore", "The given NumPy array is not writable")
        q = torch.from_numpy(qs)
    u = _fresh((*qs.shape[:-1], 2, qs.shape[-1]))
    t = torch.from_numpy(u)
    torch.bitwise_and(q, 0x0F, out=t[..., 0, :])
    torch.bitwise_right_shift(q, 4, out=t[..., 1, :])
    return u


def _high_bits(qh: np.ndarray, count: int) -> np.ndarray:
    """Bit i of each byte of (n, 32) as (n, count, 32), i < count."""
    return (qh[:, None, :] >> np.arange(count, dtype=np.uint8)[:, None]) & 1


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's twelve bytes of 6-bit (scale, min) pairs for 8 sub-blocks (llama.cpp's
    get_scale_min_k4): bytes 0-3 hold scales 0-3 in their low 6 bits and the top 2 bits of
    scales 4-7; bytes 4-7 the same for the mins; bytes 8-11 the low 4 bits of scales 4-7 (low
    nibble) and of mins 4-7 (high nibble)."""
    a, b, c = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([a & 63, (c & 15) | (a >> 6) << 4], axis=1)
    mn = np.concatenate([b & 63, c >> 4 | (b >> 6) << 4], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _codes(blocks: np.ndarray, qtype: Q) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Codes u (n_blocks, block weights) uint8 and per sub-block of 32 d and m (n_blocks, subs)
    float32, with w = d * u + m as the type defines it."""
    n = len(blocks)
    if qtype in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1):
        d = _f16(blocks, 0)
        offset = qtype in (Q.Q4_1, Q.Q5_1)
        m = _f16(blocks, 2) if offset else -(16 if qtype == Q.Q5_0 else 8) * d
        at = 4 if offset else 2
        if qtype in (Q.Q5_0, Q.Q5_1):  # 32 high bits, little-endian: bit j is weight j's
            high = np.unpackbits(blocks[:, at : at + 4], axis=1, bitorder="little") << 4
            at += 4
        u = _nibbles(blocks[:, None, at : at + 16]).reshape(n, 32)
        if qtype in (Q.Q5_0, Q.Q5_1):
            u |= high
        return u, d, m
    if qtype == Q.Q8_0:
        d = _f16(blocks, 0)
        u = np.bitwise_xor(blocks[:, 2:34], 0x80, out=_fresh((n, 32)))  # int8 q as q + 128
        # llama.cpp never writes -128; read as -127, so that no code is 0
        return np.maximum(u, 1, out=u), d, -128 * d
    # Q4_K and Q5_K: d, dmin, 12 bytes of scales, (Q5_K: 32 bytes of high bits), 128 of nibbles
    sc, mn = _k_scales(blocks[:, 4:16])
    u = _nibbles(blocks[:, -128:].reshape(n, 4, 32)).reshape(n, 8, 32)
    if qtype == Q.Q5_K:  # bit i of byte j: the high bit of sub-block i's weight j
        u |= _high_bits(blocks[:, 16:48], 8) << 4
    return u.reshape(n, 256), _f16(blocks, 0) * sc, -(_f16(blocks, 2) * mn)


def groups(data: np.ndarray, qtype: Q, shape: tuple[int, int]) -> GroupQuantized:
    """A KERNEL_BITS tensor's blocks (n, k) as the kernel's groups at its bits: GROUP_TYPES as
    stored, the others dequantized and rounded again (see the module docstring)."""
    if qtype in GROUP_TYPES:
        return stored_groups(data, qtype, shape)
    if qtype == Q.MXFP4:  # each block: an E8M0 scale, then 16 bytes of values j (low), j + 16
        blocks = np.ascontiguousarray(data).reshape(-1, 17)
        codes = torch.from_numpy(_nibbles(blocks[:, None, 1:])).reshape(shape)
        scales = torch.from_numpy(blocks[:, 0].copy()).reshape(shape[0], -1)
        return mxfp4_groups(codes, scales)
    w = torch.from_numpy(gguf.quants.dequantize(data, qtype)).reshape(shape)
    return (int4_groups if KERNEL_BITS[qtype] == 4 else int8_groups)(w)


def stored_groups(data: np.ndarray, qtype: Q, shape: tuple[int, int]) -> GroupQuantized:
    """A GROUP_TYPES tensor's blocks as the kernel's groups (see the module docstring)."""
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    u, d, m = _codes(np.ascontiguousarray(data).reshape(-1, type_size), qtype)
    bits = 8 if qtype in SHIFT_8BIT else 4
    if shift := SHIFT_8BIT.get(qtype, 0):
        u, m = u + np.uint8(shift), m - shift * d
    if not (np.abs(d).max(initial=0) <= FP16_MAX and np.abs(m).max(initial=0) <= FP16_MAX):
        raise ValueError(
            f"{qtype.name} blocks whose scale or offset is beyond fp16's range ({FP16_MAX}), "
            "which tinyllm's kernel stores them in"
        )
    n, k = shape
    return GroupQuantized(
        torch.from_numpy(u.reshape(n, k)),
        torch.from_numpy(np.ascontiguousarray(d).reshape(n, k // 32)),
        torch.from_numpy(np.ascontiguousarray(m).reshape(n, k // 32)),
        bits,
    )
