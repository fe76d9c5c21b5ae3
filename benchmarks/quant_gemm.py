"""The int4/int8 linear kernel (model/quant_linear.cpp) of this checkout against the same kernel
at another git revision, side by side in one process, on the Llama-3.2-1B shapes by activation
rows: decode (1-4 rows), batches (16) and prompts (128-512).

Both kernels are compiled here from their sources for one instruction-set level (this CPU's, or
TINYLLM_CPU_LEVEL's), each as an op of its own, on the same packed weights; the rows take turns
(base, new, torch's fp32 matmul of the dequantized weight), so a disturbance from other work
hits them alike. Printed: milliseconds (best of --reps) and new/base speed, and the integer
multiply-add rate of the new kernel in GMAC/s (two int8 codes per activation).

Run: python benchmarks/quant_gemm.py [--base main] [--rows 1 4 16 128 512] [--bits 4]
"""

import argparse
import subprocess
import tempfile
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

from tinyllm.entrypoints.bench.machine import best_seconds
from tinyllm.model import cpu_library
from tinyllm.model.quant import int4_groups, int8_groups, pack

SHAPES = [(2048, 2048), (8192, 2048), (2048, 8192)]  # (out, in): q/o, gate/up, down
ROOT = Path(__file__).parents[1]
SOURCE = "tinyllm/model/quant_linear.cpp"


def compile_kernel(name: str, text: str, header: str, level: str, where: Path) -> object:
    """`text` (a quant_linear.cpp) as the op torch.ops.<name>.quant_linear."""
    folder = where / name
    folder.mkdir()
    (folder / "cpu_ops.h").write_text(header)
    source = folder / "quant_linear.cpp"
    source.write_text(text.replace("TORCH_LIBRARY_FRAGMENT(tinyllm,", f"TORCH_LIBRARY({name},"))
    load(
        name=f"{name}_{level}",
        sources=[str(source)],
        extra_cflags=cpu_library.build_flags(level),
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
        build_directory=str(folder),
    )
    return getattr(torch.ops, name).quant_linear


def at_revision(rev: str, path: str) -> str:
    return subprocess.run(
        ["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout


@torch.inference_mode()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="main", help="git revision of the kernel to compare with")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 128, 512])
    p.add_argument("--bits", type=int, choices=[4, 8], default=4)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    level = cpu_library.level()
    header = "tinyllm/model/cpu_ops.h"
    with tempfile.TemporaryDirectory() as where:
        base = compile_kernel(
            "tinyllm_base",
            at_revision(args.base, SOURCE),
            at_revision(args.base, header),
            level,
            Path(where),
        )
        new = compile_kernel(
            "tinyllm_new",
            (ROOT / SOURCE).read_text(),
            (ROOT / header).read_text(),
            level,
            Path(where),
        )
    print(f"level {level}, threads {torch.get_num_threads()}, int{args.bits}, base {args.base}")
    print(
        f"{'shape':>11} {'rows':>5} {'base ms':>9} {'new ms':>9} {'fp32 ms':>9} "
        f"{'new/base':>9} {'new/fp32':>9} {'GMAC/s':>7}"
    )
    gen = torch.Generator().manual_seed(0)
    quantize = int4_groups if args.bits == 4 else int8_groups
    for n, k in SHAPES:
        g = quantize(torch.randn(n, k, generator=gen) * 0.02)
        packed, dense = pack(g), g.dequantize()
        for rows in args.rows:
            x = torch.randn(rows, k, generator=gen)
            runs = {
                "base": lambda: base(x, packed, n, args.bits),  # noqa: B023
                "new": lambda: new(x, packed, n, args.bits),  # noqa: B023
                "fp32": lambda: x @ dense.T,  # noqa: B023
            }
            if not torch.equal(runs["base"](), runs["new"]()):
                print(f"  {n}x{k} rows {rows}: new and base outputs differ")
            best = dict.fromkeys(runs, float("inf"))
            for _ in range(args.reps):
                for name, fn in runs.items():
                    best[name] = min(best[name], best_seconds(fn, reps=1))
            macs = 2 * rows * n * k / best["new"] / 1e9
            print(
                f"{n:>5}x{k:<5} {rows:>5} {best['base'] * 1e3:>9.2f} {best['new'] * 1e3:>9.2f} "
                f"{best['fp32'] * 1e3:>9.2f} {best['base'] / best['new']:>8.2f}x "
                f"{best['fp32'] / best['new']:>8.2f}x {macs:>7.1f}"
            )


if __name__ == "__main__":
    main()
