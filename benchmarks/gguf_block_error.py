"""What packing each GGUF block type for tinyllm's kernel changes in its weights: random blocks
in the type's byte layout (tests/gguf_encoders.py's random_blocks), decoded by the gguf
package's own dequantize (the oracle) and by unpacking what tinyllm packs
(loaders/gguf_blocks.py).

    python -m benchmarks.gguf_block_error [--rows 256 --cols 4096]   (from the repository root)

Per type: the kernel bits, whether the blocks are packed as stored or rounded again, bytes per
weight in the file and packed, the largest change over the largest |w|, the RMS change over the
RMS weight, and, for the types rounded again, the RMS change over the RMS error the type's own
rounding leaves in a weight (its sub-block's step / sqrt(12)): what a second rounding adds to
the first.
"""

import argparse

import gguf
import numpy as np
import torch

from tests.gguf_encoders import random_blocks
from tinyllm.loaders.gguf_blocks import GROUP_TYPES, KERNEL_BITS, groups
from tinyllm.model.quant import pack, unpack

Q = gguf.GGMLQuantizationType
# The code bytes of each type rounded again, and the bytes that set every code to the grid's
# point 0 and to point 1 (Q6_K: q = 32 and 33; Q3_K: q = 0 and 1 with the high bit set, which
# means no -4; Q2_K: 0 and 1): their difference is each sub-block's step d * scale.
CODE_BYTES = {
    Q.Q6_K: [(slice(0, 128), 0x00, 0x11), (slice(128, 192), 0xAA, 0xAA)],
    Q.Q3_K: [(slice(0, 32), 0xFF, 0xFF), (slice(32, 96), 0x00, 0x55)],
    Q.Q2_K: [(slice(16, 80), 0x00, 0x55)],
}


def own_step(blocks: np.ndarray, qtype: Q) -> torch.Tensor:
    """Each weight's step on its type's own grid, found through the oracle."""
    points = []
    for point in (1, 2):
        b = blocks.reshape(-1, gguf.GGML_QUANT_SIZES[qtype][1]).copy()
        for where, *values in CODE_BYTES[qtype]:
            b[:, where] = values[point - 1]
        points.append(torch.from_numpy(gguf.quants.dequantize(b.reshape(blocks.shape), qtype)))
    return (points[1] - points[0]).double().abs()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--cols", type=int, default=4096, help="a multiple of 256")
    args = parser.parse_args()
    columns = ["type", "kernel bits", "packed", "file B/weight", "packed B/weight"]
    columns += ["max change / max abs w", "RMS change / RMS w", "RMS change / own rounding"]
    print("| " + " | ".join(columns) + " |\n" + "|---" * len(columns) + "|")
    for qtype in KERNEL_BITS:
        blocks = random_blocks((args.rows, args.cols), qtype, np.random.default_rng(0))
        oracle = torch.from_numpy(gguf.quants.dequantize(blocks, qtype)).double()
        g = groups(blocks, qtype, (args.rows, args.cols))
        packed = pack(g)
        change = unpack(packed, g.bits)[: args.rows].double() - oracle
        how = "as stored" if qtype in GROUP_TYPES else "rounded again"
        rms = change.pow(2).mean().sqrt()
        added = "-"
        if qtype in CODE_BYTES:
            added = f"{rms / (own_step(blocks, qtype).pow(2).mean().sqrt() / 12**0.5):.2f}"
        print(
            f"| {qtype.name} | {g.bits} | {how} | {blocks.nbytes / oracle.numel():.4f} "
            f"| {packed.numel() / oracle.numel():.4f} "
            f"| {change.abs().max() / oracle.abs().max():.2e} "
            f"| {rms / oracle.pow(2).mean().sqrt():.2e} | {added} |"
        )


if __name__ == "__main__":
    main()
