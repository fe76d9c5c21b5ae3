"""quant_linear's AMX tile products against its AVX512-VNNI path, on a CPU with AMX: the same
source built at both levels in one process, each call checked for equal bits and timed, the
two alternating.

The library in use is the avx512amx build (tinyllm's own, as `LLM()` loads it); the other is
quant_linear.cpp built at avx512vnni under another op namespace. Shapes: the default model's
projections and the Llama-3.2-1B shape's MLP, 4- and 8-bit, bf16 activations. `--cold` runs
each call on the next of 120 copies of the weights, so they come from memory as in a model's
step, not from the cache.

Run: python benchmarks/amx_tiles.py [--threads 1] [--rows 1 5 8 64 512] [--cold]
"""

import argparse
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

from tinyllm.model import cpu_library
from tinyllm.model.cpu_library import HERE, build_flags
from tinyllm.model.quant import int4_groups, int8_groups, pack

SHAPES = {  # (in, out)
    "smollm qkv": (576, 960),
    "smollm gate_up": (576, 3072),
    "smollm down": (1536, 576),
    "1b gate_up": (2048, 16384),
    "1b down": (8192, 2048),
}


def vnni_op():
    """quant_linear built at the avx512vnni level, as torch.ops.tinyllm_vnni.quant_linear."""
    source = (HERE / "quant_linear.cpp").read_text()
    fragment = "TORCH_LIBRARY_FRAGMENT(tinyllm"
    source = source.replace(f"{fragment},", f"{fragment}_vnni,")
    source = source.replace('#include "cpu_ops.h"', f'#include "{HERE / "cpu_ops.h"}"')
    path = Path(tempfile.mkdtemp()) / "quant_linear_vnni.cpp"
    path.write_text(source)
    load(
        name="tinyllm_quant_linear_vnni_bench",
        sources=[str(path)],
        extra_cflags=build_flags("avx512vnni"),
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
    )
    return torch.ops.tinyllm_vnni.quant_linear


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 5, 8, 16, 64, 512])
    p.add_argument("--cold", action="store_true", help="weights from memory, not the cache")
    args = p.parse_args()
    if cpu_library.level() != "avx512amx" or cpu_library.library_error():
        raise SystemExit(f"this CPU's build is {cpu_library.level()}, not avx512amx: no AMX")
    amx, vnni = torch.ops.tinyllm.quant_linear, vnni_op()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    print(f"{args.threads} thread(s), {'cold' if args.cold else 'cached'} weights, ms per call")
    print("| shape | bits | " + " | ".join(f"{r} rows" for r in args.rows) + " |")
    print("|---|---|" + "---|" * len(args.rows))
    for name, (k, n) in SHAPES.items():
        for bits, quantize in ((4, int4_groups), (8, int8_groups)):
            w = pack(quantize(torch.randn(n, k, generator=gen) / k**0.5))
            copies = [w] * (1 if not args.cold else max(1, (120 << 20) // w.numel()))
            copies = [c.clone() for c in copies] if args.cold else copies
            cells = []
            for rows in args.rows:
                x = torch.randn(rows, k, generator=gen).bfloat16()
                same = torch.equal(amx(x, w, n, bits), vnni(x, w, n, bits))
                calls = max(len(copies), int(2e7 // (k * n * rows)) + 1)
                best = {amx: float("inf"), vnni: float("inf")}
                for _ in range(3):
                    for op in (amx, vnni):
                        start = time.perf_counter()
                        for i in range(calls):
                            op(x, copies[i % len(copies)], n, bits)
                        best[op] = min(best[op], (time.perf_counter() - start) / calls)
                ratio, flag = best[vnni] / best[amx], "" if same else " BITS DIFFER"
                times = f"{1e3 * best[amx]:.3f} vs {1e3 * best[vnni]:.3f}"
                cells.append(f"{times} ({ratio:.2f}x){flag}")
            print(f"| {name} | {bits} | " + " | ".join(cells) + " |", flush=True)
    print("each cell: AMX build vs VNNI build (VNNI / AMX); the two differ only from 5 rows")


if __name__ == "__main__":
    main()
