"""Decode attention of one layer: the CPU backend (in place) against the reference (gather+SDPA).

SmolLM2-135M's attention shapes (9 query heads, 3 KV heads, head_dim 64), fp32 or bf16
(`--dtype`; the default model runs bf16 activations on CPUs with native bf16), blocks of 16,
`--batch` decode rows of `--ctx` tokens each, their blocks shuffled through the pool as a
long-running engine leaves them. Several layers' caches are cycled through so that K and V come
from memory, not from the last-level cache, as in a real step. Printed, per layer:

    bound      K and V bytes read once, at the copy bandwidth measured in this run
    reference  ReferenceBackend.attend (gather every block, then SDPA)
    cpu        CPUBackend.attend (the kernel reading the blocks in place)

each the best of `--reps` after a warm-up, taking turns, and the ratios cpu / bound and
reference / cpu. `--queries N`: each decode row a verified draft of speculative decoding, N new
tokens (the sampled one and N - 1 drafts) at the end of its context, one work item of the
kernel. `--q-scale S`: q times S, the scores spread S times wider; past a spread of ~80 a key
far below its row's maximum gets a weight near fast_exp's floor (1.6e-38), and its V row times
that is a denormal (what the kernel's flush-to-zero mode is for). Then chunked prefills:
`--prefill-rows` rows of `--prefill-new` new tokens after `--prefill-ctx` earlier ones (each
combination), both backends, with the attention FLOP rate each reaches. `--window W`: a
sliding window (a query sees itself and the W - 1 keys before it), the bound and FLOPs counted
over the keys the window keeps.

Run: python benchmarks/decode_attention.py [--batch 64] [--ctx 512] [--threads 2]
[--dtype bfloat16] [--window 256] [--queries 7] [--q-scale 40]
"""

import argparse
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from tinyllm.model.attention.backend import AttentionBackend, AttentionMetadata
from tinyllm.model.attention.cpu import load_cpu_backend
from tinyllm.model.attention.reference import ReferenceBackend

HQ, HKV, D = 9, 3, 64
BLOCK = 16


def last_level_cache_bytes() -> int:
    """The L3's size (Linux reports it in sysfs), else 32 MiB, common on these machines."""
    try:
        size = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
    except OSError:
        return 32 << 20
    return int(size.rstrip("KMG")) << {"K": 10, "M": 20, "G": 30}.get(size[-1], 0)


def step_metadata(lens: list[int], new: list[int], gen: torch.Generator) -> AttentionMetadata:
    """Row r has `new[r]` new tokens at the end of its `lens[r]`; blocks shuffled over the pool."""
    counts = [math.ceil(L / BLOCK) for L in lens]
    pool = sum(counts)
    tables = torch.full((len(lens), max(counts)), pool)  # padded with the scratch block
    for r, ids in enumerate(torch.randperm(pool, generator=gen).split(counts)):
        tables[r, : len(ids)] = ids
    slots = []
    for r, (L, n) in enumerate(zip(lens, new, strict=True)):
        pos = torch.arange(L - n, L)
        slots.append(tables[r, pos // BLOCK] * BLOCK + pos % BLOCK)
    return AttentionMetadata(
        slot_mapping=torch.cat(slots),
        block_tables=tables,
        seq_lens=torch.tensor(lens),
        query_start_loc=torch.tensor([0, *new]).cumsum(0),
        num_decodes=sum(n == 1 for n in new),
        seq_lens_cpu=lens,
        query_lens_cpu=new,
    )


def best_interleaved(fns: list[Callable[[], object]], reps: int) -> list[float]:
    """The fastest of `reps` timed calls of each function after a warm-up, the functions taking
    turns so that other work on a shared machine disturbs them all alike."""
    for fn in fns:
        fn()
    best = [math.inf] * len(fns)
    for _ in range(reps):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def attention_runs(
    cpu: AttentionBackend,
    lens: list[int],
    new: list[int],
    cold: bool,
    dtype: torch.dtype,
    window: int | None,
    q_scale: float = 1.0,
) -> tuple[list[Callable[[], Tensor]], int]:
    """Functions running the reference's and the CPU backend's attend over `n` layers' caches
    (random K and V, the same tables), and `n`. `cold`: enough layers to overflow twice the
    last-level cache, so K and V come from memory as in a real step; else one (compute-bound)."""
    gen = torch.Generator().manual_seed(0)
    meta = step_metadata(lens, new, gen)
    kv_bytes = 2 * sum(lens) * HKV * D * dtype.itemsize
    n_layers = math.ceil(2 * last_level_cache_bytes() / kv_bytes) if cold else 1
    shape = (meta.block_tables.max() + 1, BLOCK, HKV, D)
    caches = [
        (torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype))
        for _ in range(n_layers)
    ]
    N = sum(new)
    q = (torch.randn(N, HQ, D, generator=gen) * q_scale).to(dtype)
    k = torch.randn(N, HKV, D, generator=gen).to(dtype)
    v = torch.randn(N, HKV, D, generator=gen).to(dtype)
    for kc, vc in caches:
        AttentionBackend.write(k, v, kc, vc, meta)

    def runner(backend: AttentionBackend) -> Callable[[], Tensor]:
        def run() -> Tensor:
            for kc, vc in caches:
                out = backend.attend(q, k, v, kc, vc, meta, D**-0.5, window)
            return out

        return run

    runs = [runner(ReferenceBackend()), runner(cpu)]
    ref, fast = (run() for run in runs)
    # Timing the same maths (bf16 outputs: within their rounding).
    tol = (1e-2, 1e-2) if dtype == torch.bfloat16 else (1e-4, 1e-5)
    torch.testing.assert_close(fast, ref, rtol=tol[0], atol=tol[1])
    return runs, n_layers


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--prefill-rows", type=int, default=4)
    p.add_argument("--prefill-new", type=int, nargs="+", default=[256])
    p.add_argument("--prefill-ctx", type=int, nargs="+", default=[512])
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--window", type=int, default=None, help="a sliding window of W keys")
    p.add_argument("--queries", type=int, default=1, help="new tokens per decode row")
    p.add_argument("--q-scale", type=float, default=1.0, help="q times this: wider scores")
    args = p.parse_args()
    window = args.window
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)
    cpu, why = load_cpu_backend()
    if cpu is None:
        raise SystemExit(why)

    copy_bytes = 2 * last_level_cache_bytes()  # the copy that measures the bandwidth
    src = torch.ones(copy_bytes // 4)
    dst = torch.empty_like(src)
    lens = [args.ctx] * args.batch
    new = [args.queries] * args.batch
    runs, n_layers = attention_runs(cpu, lens, new, True, dtype, window, args.q_scale)
    copy, ref, fast = best_interleaved([lambda: dst.copy_(src), *runs], args.reps)
    ref, fast = ref / n_layers, fast / n_layers
    bandwidth = copy_bytes / copy
    seen = sum(min(L, window or L) for L in lens)  # the keys the decode rows read
    bound = 2 * seen * HKV * D * dtype.itemsize / bandwidth
    print(
        f"{torch.backends.cpu.get_cpu_capability()}, {args.dtype}, {args.threads} threads, ", end=""
    )
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s, window {window}, q x {args.q_scale:g}")
    print(f"decode {args.batch} x {args.ctx}, {args.queries} new each: ", end="")
    print(f"bound {1e3 * bound:.2f} ms, ", end="")
    print(f"reference {1e3 * ref:.2f} ms, cpu {1e3 * fast:.2f} ms")
    print(f"  cpu / bound {fast / bound:.2f}, reference / cpu {ref / fast:.1f}")

    rows = args.prefill_rows
    for earlier in args.prefill_ctx:
        for n in args.prefill_new:
            keys = sum(min(earlier + i + 1, window or earlier + n) for i in range(n))
            flops = 4 * HQ * D * rows * keys
            runs, _ = attention_runs(cpu, [earlier + n] * rows, [n] * rows, False, dtype, window)
            ref, fast = best_interleaved(runs, args.reps)
            print(f"prefill {rows} x {n} new after {earlier}: ", end="")
            print(f"reference {1e3 * ref:.2f} ms ({flops / ref / 1e9:.0f} GFLOP/s), ", end="")
            print(f"cpu {1e3 * fast:.2f} ms ({flops / fast / 1e9:.0f} GFLOP/s), ", end="")
            print(f"reference / cpu {ref / fast:.2f}")


if __name__ == "__main__":
    main()
