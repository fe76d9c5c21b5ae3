"""GGUF blocks written by the tests and the benchmarks, which the gguf package cannot write:
random blocks in any type's byte layout (`random_blocks`), and Q4_K and Q6_K blocks quantized
from weights as llama.cpp's reference quantizers (ggml-quants.c: quantize_row_q4_K_ref,
quantize_row_q6_K_ref, what llama-quantize runs without an importance matrix) make them
(`quantize`). Both are checked against the gguf package's own `dequantize` in
tests/test_kquant.py. Here and not in a test module so that benchmarks/ imports it without
pytest; under tests/ because tinyllm itself never writes blocks.
"""

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType

# Each type's fp16 fields (byte offset, size): the scale d, then the min or offset if any, sized
# so that weights stay within about +-0.1. Any other byte pattern is a valid block.
FP16_FIELDS = {
    Q.Q4_0: ((0, 0.1 / 8),),
    Q.Q4_1: ((0, 0.1 / 15), (2, -0.05)),
    Q.Q5_0: ((0, 0.1 / 16),),
    Q.Q5_1: ((0, 0.1 / 31), (2, -0.05)),
    Q.Q8_0: ((0, 0.1 / 127),),
    Q.Q2_K: ((80, 0.1 / 45), (82, 0.05 / 15)),  # d * (sc <= 15) * (q <= 3) - dmin * (m <= 15)
    Q.Q3_K: ((108, 0.1 / 128),),  # d * (sc in -32..31) * (q in -4..3)
    Q.Q4_K: ((0, 0.1 / 945), (2, 0.05 / 63)),  # d * (sc <= 63) * (q <= 15) - dmin * (m <= 63)
    Q.Q5_K: ((0, 0.1 / 1953), (2, 0.05 / 63)),  # q <= 31
    Q.Q6_K: ((208, 0.1 / 4096),),  # d * (sc in -128..127) * (q in -32..31)
}


def random_blocks(shape: tuple[int, ...], qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """Random blocks of `qtype` for a weight of `shape`, as the file stores them."""
    blocks = rng.integers(0, 256, gguf.quants.quant_shape_to_byte_shape(shape, qtype), np.uint8)
    flat = blocks.reshape(-1, gguf.GGML_QUANT_SIZES[qtype][1])
    for at, size in FP16_FIELDS.get(qtype, ()):
        values = (size * rng.uniform(0.5, 1.0, len(flat))).astype(np.float16)
        flat[:, at : at + 2] = values[:, None].view(np.uint8)
    if qtype == Q.MXFP4:  # E8M0 scales 2^-8..2^-6: weights within about +-0.1, held exactly
        flat[:, 0] = rng.integers(119, 122, len(flat))
    if qtype == Q.Q8_0:  # llama.cpp never writes the code -128 (tinyllm reads it as -127)
        codes = flat[:, 2:].view(np.int8)
        codes[codes == -128] = -127
    # Sub-blocks of 16 with scales near their super-block's largest, as a quantizer makes them
    # from weights of one distribution: random bytes give any ratio of the two scales that share
    # one of the kernel's groups, the worst case for rounding them to one grid.
    if qtype == Q.Q6_K:  # int8 scales: 64..127 either sign
        magnitudes = rng.integers(64, 128, (len(flat), 16))
        flat[:, 192:208] = (magnitudes * rng.choice([-1, 1], magnitudes.shape)).astype(np.uint8)
    if qtype == Q.Q3_K:  # 6-bit scales minus 32: top 2 bits 00 or 11, so |scale| >= 16
        fields = rng.choice([0, 3], (len(flat), 4, 4)) << np.arange(0, 8, 2)
        flat[:, 104:108] = fields.sum(-1)
    if qtype == Q.Q2_K:  # 4-bit scales in the low nibbles: 8..15
        flat[:, :16] = flat[:, :16] & 0xF0 | rng.integers(8, 16, (len(flat), 16))
    return blocks


# ---- llama.cpp's reference quantizers, vectorized over sub-blocks ----

F32 = np.float32


def _fp16_bytes(values: np.ndarray) -> np.ndarray:
    """(n,) float32 -> (n, 2) the fp16 bytes, and the fp16 value is what a decoder reads."""
    return values.astype(np.float16)[:, None].view(np.uint8)


def _as_f32(fp16_bytes: np.ndarray) -> np.ndarray:
    return fp16_bytes.copy().view(np.float16).astype(F32)


def _min_offset_scales(x: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int):
    """llama.cpp's make_qkx2_quants (squared error) on each row of x (n, 32): the scale and
    min (w ~ scale * L - min, min >= 0) that minimize the error weighted by w = rms + |x|, over
    nstep + 1 trial grids, and the codes L."""
    weights = np.sqrt(np.mean(x * x, axis=1, keepdims=True)) + np.abs(x)
    lo = np.minimum(x.min(axis=1), 0)[:, None]
    span = x.max(axis=1, keepdims=True) - lo
    flat = span[:, 0] == 0
    span[flat] = 1  # all codes 0 there, scale 0
    sum_w, sum_x = weights.sum(1), (weights * x).sum(1)

    def codes(iscale):
        return np.clip(np.rint(iscale * (x - lo)), 0, nmax).astype(F32)

    def error(scale, low, levels):
        diff = scale[:, None] * levels + low - x
        return (weights * diff * diff).sum(1)

    best_codes = codes(F32(nmax) / span)
    scale, low = (span / F32(nmax))[:, 0], lo[:, 0].copy()
    best = error(scale, lo, best_codes)
    for step in range(nstep + 1):
        levels = codes(F32(rmin + rdelta * step + nmax) / span)
        sum_l, sum_l2 = (weights * levels).sum(1), (weights * levels * levels).sum(1)
        sum_xl = (weights * levels * x).sum(1)
        det = sum_w * sum_l2 - sum_l * sum_l
        ok = det > 0
        det[~ok] = 1
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
        this_low = (sum_l2 * sum_x - sum_l * sum_xl) / det
        positive = this_low > 0
        this_low[positive] = 0
        this_scale[positive] = (sum_xl / np.where(sum_l2 > 0, sum_l2, 1))[positive]
        err = error(this_scale, this_low[:, None], levels)
        better = ok & (err < best)
        best_codes[better], best[better] = levels[better], err[better]
        scale[better], low[better] = this_scale[better], this_low[better]
    scale[flat], best_codes[flat] = 0, 0
    return scale, -low, best_codes


def _symmetric_scales(x: np.ndarray, nmax: int) -> np.ndarray:
    """llama.cpp's make_qx_quants (rmse_type 1: weights x^2) on each row of x: the scale of
    codes -nmax..nmax-1 that minimizes the weighted error over 19 trial grids, its sign that of
    the row's largest |w| (which gets code -nmax)."""
    biggest = np.take_along_axis(x, np.abs(x).argmax(axis=1)[:, None], axis=1)
    zero = np.abs(biggest[:, 0]) < 1e-15
    biggest[zero] = 1
    weights = x * x
    scale = np.zeros(len(x), F32)
    best = np.zeros(len(x), F32)
    for step in [0, *range(-9, 0), *range(1, 10)]:
        levels = np.clip(np.rint(-F32(nmax + 0.1 * step) / biggest * x), -nmax, nmax - 1)
        sum_lx, sum_l2 = (weights * x * levels).sum(1), (weights * levels * levels).sum(1)
        ok = sum_l2 > 0
        this = np.where(ok, sum_lx / np.where(ok, sum_l2, 1), 0).astype(F32)
        better = np.ones_like(ok) if step == 0 else ok & (sum_lx * sum_lx > best * sum_l2)
        scale[better], best[better] = this[better], (this * sum_lx)[better]
    scale[zero] = 0
    return scale


def _quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """(n, 256) weights -> (n, 144) Q4_K blocks (quantize_row_q4_K_ref)."""
    n = len(w)
    sub = w.reshape(n * 8, 32)
    scale, low, codes = _min_offset_scales(sub, 15, -1.0, 0.1, 20)
    scale, low, codes = scale.reshape(n, 8), low.reshape(n, 8), codes.reshape(n, 8, 32)
    max_scale, max_low = np.maximum(scale.max(1), 0), np.maximum(low.max(1), 0)
    inv_scale = np.where(max_scale > 0, F32(63) / np.where(max_scale > 0, max_scale, 1), 0)
    inv_low = np.where(max_low > 0, F32(63) / np.where(max_low > 0, max_low, 1), 0)
    ls = np.clip(np.rint(inv_scale[:, None] * scale), 0, 63).astype(np.uint8)
    lm = np.clip(np.rint(inv_low[:, None] * low), 0, 63).astype(np.uint8)
    d_bytes, dmin_bytes = _fp16_bytes(max_scale / 63), _fp16_bytes(max_low / 63)
    d = _as_f32(d_bytes) * ls  # each sub-block's step as a decoder reads it
    dm = _as_f32(dmin_bytes) * lm
    again = np.clip(
        np.rint((w.reshape(n, 8, 32) + dm[..., None]) / np.where(d > 0, d, 1)[..., None]), 0, 15
    )
    codes = np.where((d > 0)[..., None], again, codes).astype(np.uint8).reshape(n, 4, 2, 32)
    scales = np.concatenate(
        [
            ls[:, :4] | (ls[:, 4:] >> 4) << 6,
            lm[:, :4] | (lm[:, 4:] >> 4) << 6,
            (ls[:, 4:] & 15) | (lm[:, 4:] & 15) << 4,
        ],
        axis=1,
    )
    qs = (codes[:, :, 0] | codes[:, :, 1] << 4).reshape(n, 128)
    return np.concatenate([d_bytes, dmin_bytes, scales, qs], axis=1)


def _quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """(n, 256) weights -> (n, 210) Q6_K blocks (quantize_row_q6_K_ref)."""
    n = len(w)
    scale = _symmetric_scales(w.reshape(n * 16, 16), 32).reshape(n, 16)
    pick = np.abs(scale).argmax(axis=1)[:, None]
    max_scale = np.take_along_axis(scale, pick, axis=1)[:, 0]
    zero = np.abs(max_scale) < 1e-15
    iscale = np.where(zero, 0, F32(-128) / np.where(zero, 1, max_scale))
    d_bytes = _fp16_bytes(np.where(zero, 0, 1 / np.where(zero, 1, iscale)))
    sc = np.minimum(127, np.rint(iscale[:, None] * scale)).astype(np.int8)
    step = (_as_f32(d_bytes) * sc)[..., None]
    levels = np.rint(w.reshape(n, 16, 16) / np.where(step != 0, step, 1))
    codes = np.where(step != 0, np.clip(levels, -32, 31) + 32, 32).astype(np.uint8)
    codes = codes.reshape(n, 2, 4, 32)  # two halves of 128: four runs of 32 each
    low, high = codes & 15, codes >> 4
    ql = np.stack([low[:, :, 0] | low[:, :, 2] << 4, low[:, :, 1] | low[:, :, 3] << 4], axis=2)
    qh = high[:, :, 0] | high[:, :, 1] << 2 | high[:, :, 2] << 4 | high[:, :, 3] << 6
    return np.concatenate(
        [ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8), d_bytes], axis=1
    )


QUANTIZERS = {Q.Q4_K: _quantize_q4_k, Q.Q6_K: _quantize_q6_k}


def quantize(w: np.ndarray, qtype: Q) -> np.ndarray:
    """A weight (rows, k), k a multiple of 256, as the file stores `qtype` (Q4_K or Q6_K);
    other types: the gguf package's own quantize."""
    if qtype not in QUANTIZERS:
        return gguf.quants.quantize(w, qtype)
    rows, k = w.shape
    blocks = QUANTIZERS[qtype](np.ascontiguousarray(w, F32).reshape(-1, 256))
    return blocks.reshape(rows, -1)
