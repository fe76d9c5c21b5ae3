"""The CUDA attention backend on a GPU: correct against the reference, and how fast.

1. Correctness: random batches (decode rows, prefill rows with and without earlier context) in
   fp32, fp16 and bf16, blocks of 1 and 16 tokens, SmolLM2-135M heads (9 query, 3 KV, head_dim
   64) and Llama-3-8B heads (32, 8, 128), plus two odd shapes. Each is compared with the
   reference backend; every cache slot that no row's context holds is NaN for the kernel, which
   must never read one. Exits 1 if any case is off by more than its dtype's tolerance.
2. Decode speed, bf16, blocks of 16: one layer's attention by the reference (gather + SDPA) and
   by the kernel, in ms (median of 20, the L2 cache flushed before each run, as the 30 layers
   of a real step each read their own cache), against the bound: the K and V bytes at the
   bandwidth a large device copy reaches (its reads plus writes).

Run from the repository root, on a machine with CUDA and triton:
    python3 benchmarks/cuda_attention_check.py
Needs only torch and tinyllm.model.attention (not the package's other dependencies).
"""

import itertools
import math
import random
import statistics
import sys
import traceback

import torch

from tinyllm.model.attention.backend import AttentionBackend, AttentionMetadata
from tinyllm.model.attention.cuda import load_cuda_backend
from tinyllm.model.attention.reference import ReferenceBackend

# A case passes when |cuda - reference| <= tol * (1 + |reference|) everywhere: an output's
# rounding step grows with its size (a bf16 ulp is 1/64 at 2..4).
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}
SMOLLM2 = (9, 3, 64)  # query heads, KV heads, head_dim
LLAMA_8B = (32, 8, 128)
# (dtype, block size, heads), each in three batches: mixed, decode only, prefill only.
CASES = [
    (dtype, block_size, heads)
    for dtype in (torch.float32, torch.float16, torch.bfloat16)
    for block_size in (1, 16)
    for heads in (SMOLLM2, LLAMA_8B)
] + [
    (torch.float16, 16, (4, 4, 80)),  # no grouping; head_dim not a power of two
    (torch.bfloat16, 8, (8, 1, 32)),  # eight query heads per KV head
]
BATCH_KINDS = ("mixed", "decode", "prefill")


def make_batch(decode_lens, prefills, heads, block_size, dtype, device, seed=0):
    """One step's inputs: q, k, v, k_cache, v_cache, meta. `decode_lens`: the context length of
    each decode row; `prefills`: (new tokens, context length) per prefill row. Each row's blocks
    are random blocks of the pool (as after allocation churn), its table padded with scratch."""
    torch.manual_seed(seed)
    n_heads, kv_heads, head_dim = heads
    rows = [(1, L) for L in decode_lens] + list(prefills)
    counts = [math.ceil(L / block_size) for _, L in rows]
    num_blocks = sum(counts) + 2  # two blocks no row holds
    free = torch.randperm(num_blocks).tolist()
    tables, slots, taken = [], [], 0
    for (n, L), c in zip(rows, counts, strict=True):
        blocks, taken = free[taken : taken + c], taken + c
        tables.append(blocks + [num_blocks] * (max(counts) - c))  # block num_blocks: scratch
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(L - n, L)]

    def long(values):
        return torch.tensor(values, dtype=torch.long, device=device)

    def randn(*shape):
        return torch.randn(*shape, dtype=dtype, device=device)

    n_tokens = sum(n for n, _ in rows)
    meta = AttentionMetadata(
        slot_mapping=long(slots),
        block_tables=long(tables),
        seq_lens=long([L for _, L in rows]),
        query_start_loc=long([0, *itertools.accumulate(n for n, _ in rows)]),
        num_decodes=len(decode_lens),
        seq_lens_cpu=[L for _, L in rows],
        query_lens_cpu=[n for n, _ in rows],
    )
    cache_shape = (num_blocks + 1, block_size, kv_heads, head_dim)
    return (
        randn(n_tokens, n_heads, head_dim),
        randn(n_tokens, kv_heads, head_dim),
        randn(n_tokens, kv_heads, head_dim),
        randn(*cache_shape),
        randn(*cache_shape),
        meta,
    )


def poisoned(cache, meta):
    """A copy of the cache with NaN in every slot outside the rows' contexts: the scratch block,
    blocks no row holds, the tail of each row's last block."""
    _, bs, H, D = cache.shape
    p = torch.arange(meta.block_tables.shape[1] * bs, device=cache.device)
    slots = meta.block_tables[:, p // bs] * bs + p % bs  # (R, width * bs): each row's positions
    held = slots[p[None, :] < meta.seq_lens[:, None]]
    out = torch.full_like(cache, math.nan).view(-1, H, D)
    out[held] = cache.view(-1, H, D)[held]
    return out.view_as(cache)


def random_rows(rng: random.Random, kind: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Decode context lengths and prefill (new tokens, context length) rows of one batch:
    contexts span several 64-key steps, prompts several query tiles."""
    decodes = [] if kind == "prefill" else [rng.randint(1, 300) for _ in range(rng.randint(1, 5))]
    if kind == "decode":
        return decodes, []
    first = rng.randint(1, 90)  # a first chunk: the whole context is new
    earlier, n = rng.randint(1, 200), rng.randint(2, 90)  # a later chunk
    prefills = [(first, first), (n, earlier + n), (1, rng.randint(2, 100))]
    rng.shuffle(prefills)
    return decodes, prefills


def error_ratio(backend: AttentionBackend, dtype, block_size, heads, kind: str, seed: int):
    """Over one random batch (both backends write, then attend): the largest |backend -
    reference| and its largest ratio to the tolerance, inf where the backend gave NaN."""
    decodes, prefills = random_rows(random.Random(seed), kind)
    q, k, v, kc, vc, meta = make_batch(decodes, prefills, heads, block_size, dtype, "cuda", seed)
    scale = heads[2] ** -0.5
    ref = ReferenceBackend().forward(q, k, v, kc.clone(), vc.clone(), meta, scale).float()
    out = backend.forward(q, k, v, poisoned(kc, meta), poisoned(vc, meta), meta, scale)
    err = (out.float() - ref).abs().nan_to_num(nan=math.inf)
    return err.max().item(), (err / (TOLERANCE[dtype] * (1 + ref.abs()))).max().item()


def correctness(backend: AttentionBackend) -> bool:
    print("correctness: cuda against the reference, over a mixed, a decode-only and a prefill-only")
    print("batch each; passes at error / (tol * (1 + |reference|)) <= 1")
    print(f"{'dtype':>16}{'block':>7}{'heads':>13}{'max error':>11}{'tol':>8}{'worst ratio':>13}")
    all_ok, shown = True, False
    for dtype, block_size, heads in CASES:
        try:
            errors = [
                error_ratio(backend, dtype, block_size, heads, kind, seed)
                for seed, kind in enumerate(BATCH_KINDS)
            ]
            err, ratio = max(e for e, _ in errors), max(r for _, r in errors)
            ok, cells = ratio <= 1, f"{err:>11.2e}{TOLERANCE[dtype]:>8.0e}{ratio:>13.3f}"
        except Exception:
            if not shown:  # the first error in full; the rest likely follow from it
                traceback.print_exc()
            ok, cells, shown = False, f"{'error':>32}", True
        all_ok &= ok
        head_cell = "{}/{} x {}".format(*heads)
        print(f"{str(dtype):>16}{block_size:>7}{head_cell:>13}{cells}  {'ok' if ok else 'FAIL'}")
    return all_ok


def median_ms(fn, reps: int = 20) -> float:
    """Median GPU time of fn, after warm-up, the L2 cache flushed before each run. The flush
    (1 GiB, 20x an H200's L2) also keeps the GPU busy while Python launches fn's kernels, so
    the time between the events is the device's, not the launch overhead's."""
    flush = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    for _ in range(3):
        fn()
    events = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def copy_bandwidth() -> float:
    """Bytes per second a large device copy moves (reads plus writes): the rate a kernel that
    streams K and V in can at best approach."""
    src = torch.ones(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / (median_ms(lambda: dst.copy_(src)) / 1e3)


def decode_speed(backend, shape, batch: int, ctx: int, bandwidth: float) -> list[str]:
    """One row of the speed table: `batch` decode rows of `ctx` tokens, `shape`'s heads."""
    q, k, v, kc, vc, meta = make_batch([ctx] * batch, [], shape, 16, torch.bfloat16, "cuda")
    scale = shape[2] ** -0.5
    kv_bytes = 2 * batch * ctx * shape[1] * shape[2] * 2
    bound = kv_bytes / bandwidth * 1e3
    ref = median_ms(lambda: ReferenceBackend().attend(q, k, v, kc, vc, meta, scale))
    cuda = median_ms(lambda: backend.attend(q, k, v, kc, vc, meta, scale))
    cells = [f"{kv_bytes / 1e6:.0f}", f"{bound:.3f}", f"{ref:.3f}", f"{cuda:.3f}"]
    return cells + [f"{ref / cuda:.1f}x", f"{cuda / bound:.2f}"]


def speed(backend: AttentionBackend) -> None:
    bandwidth = copy_bandwidth()
    print(f"\ndecode speed, bf16, blocks of 16, one layer; copy: {bandwidth / 1e9:.0f} GB/s")
    heads = ["model", "batch", "ctx", "KV MB", "bound ms", "ref ms", "cuda ms", "ref/cuda"]
    print("".join(f"{h:>11}" for h in [*heads, "cuda/bound"]))
    for (name, shape), (batch, ctx) in itertools.product(
        [("SmolLM2", SMOLLM2), ("Llama-8B", LLAMA_8B)], [(64, 512), (256, 2048)]
    ):
        try:
            cells = [name, batch, ctx, *decode_speed(backend, shape, batch, ctx, bandwidth)]
            print("".join(f"{c:>11}" for c in cells))
        except Exception:
            traceback.print_exc()


def main() -> None:
    backend, why = load_cuda_backend()
    if backend is None:
        sys.exit(f"the CUDA backend does not load: {why}")
    import triton

    print(f"{torch.cuda.get_device_name()}: torch {torch.__version__}, triton {triton.__version__}")
    ok = correctness(backend)
    speed(backend)
    print("\nALL CORRECTNESS CASES PASS" if ok else "\nCORRECTNESS FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
