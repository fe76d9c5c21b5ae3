"""What the paged cache's gather costs in a decode step, by context length and batch size.

The decoder layers of SmolLM2-135M (30 of them: hidden 576, 9 query heads, 3 KV heads, head_dim
64, FFN 1536) with random weights (timings do not depend on the values), fp32, blocks of 16,
every sequence holding `ctx` tokens. Per layer, in ms:

    bound     K and V bytes read once, at the measured copy bandwidth
    gather    PagedLayerKV.update (write the new token, index_select every block of K and V),
              alone in a loop, and inside a real step (profiled: aten::index_select)
    sdpa      attention over the gathered (token-major) K and V, as the layer runs it
    contig    the same attention over a contiguous (B, H, T, D) cache: no gather at all

and for the whole decode step (30 layers, no LM head), the median of 5: its time with the paged
cache and with the slot cache (contiguous, read in place), in ms; the gather's share of the
paged step; the kernel time of the paged step (ms) and the memory it page-faults in (MB): the
allocator hands the gathered copies fresh pages. Each row runs in a fresh process.

Run: python benchmarks/gather_cost.py [--ctx 128 512 1024 2048] [--batch 1 16 64]
"""

import argparse
import math
import multiprocessing as mp
import resource
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.profiler import profile

from tinyllm.engine.kv_cache import PackedKVCache, SlotKVCache
from tinyllm.engine.paged_kv_cache import PagedKVCache
from tinyllm.entrypoints.bench import best_seconds, copy_bandwidth
from tinyllm.model.config import ModelConfig
from tinyllm.model.llama import DecoderLayer, Rope

SMOLLM2 = ModelConfig(
    architecture="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    tie_word_embeddings=True,
)
BLOCK = 16
COLD_BYTES = 128 << 20  # well over the 32 MiB last-level cache of these machines
REPS = 3
STEP_REPS = 5
GATHER_OP = "aten::index_select"


def filled_caches(batch: int, ctx: int, n_layers: int) -> tuple[PagedKVCache, SlotKVCache]:
    """A paged and a slot cache holding the same `batch` sequences of `ctx` random tokens."""
    c = SMOLLM2
    shape = dict(n_kv_heads=c.num_kv_heads, head_dim=c.head_dim, dtype=torch.float32, device="cpu")
    paged = PagedKVCache(
        n_layers=n_layers,
        n_slots=batch,
        n_blocks=batch * math.ceil((ctx + 1) / BLOCK),
        block_size=BLOCK,
        max_len=ctx + BLOCK,
        **shape,
    )
    slot = SlotKVCache(n_layers=n_layers, n_slots=batch, max_len=ctx + BLOCK, **shape)
    prefill = PackedKVCache(n_layers, [ctx] * batch, **shape)
    for t in prefill.k + prefill.v:
        t.normal_()
    for cache in (paged, slot):
        cache.admit(list(range(batch)), prefill)
    return paged, slot


def profiled_run(step: Callable[[], None], reps: int = STEP_REPS) -> dict[str, float]:
    """The median (by wall time) of a few profiled runs of a step: its wall time, the time in
    aten::index_select, and the kernel time and fresh memory it page-faulted."""
    step()
    runs = []
    for _ in range(reps):
        before = resource.getrusage(resource.RUSAGE_SELF)
        start = time.perf_counter()
        with profile() as prof:
            step()
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_SELF)
        events = prof.key_averages()
        runs.append(
            {
                "wall": wall,
                "gather": sum(e.self_cpu_time_total for e in events if e.key == GATHER_OP) / 1e6,
                "sys": after.ru_stime - before.ru_stime,
                "faulted": (after.ru_minflt - before.ru_minflt) * resource.getpagesize(),
            }
        )
    return sorted(runs, key=lambda r: r["wall"])[reps // 2]


@torch.inference_mode()
def measure(batch: int, ctx: int, bandwidth: float) -> dict:
    """Per-layer times of the pieces and whole-step times, in seconds; faulted bytes per step."""
    c = SMOLLM2
    kv_bytes = 2 * batch * ctx * c.num_kv_heads * c.head_dim * 4
    # Cycle through enough layers' caches to overflow the last-level cache, as the 30 layers
    # of a real step do; one layer's KV read over and over would be served from L3.
    n = min(c.num_layers, math.ceil(COLD_BYTES / kv_bytes))
    paged, slot = filled_caches(batch, ctx, n)
    torch.manual_seed(0)
    layers = [DecoderLayer(c).eval() for _ in range(c.num_layers)]
    rope = Rope(c)
    x = torch.randn(batch, 1, c.hidden_size)

    def stepper(cache):
        cos, sin = cache.begin_step(1, rope)
        views = [cache.layer(i) for i in range(n)]

        def step() -> None:
            h = x
            for i, layer in enumerate(layers):
                h = layer(h, cos, sin, views[i % n])

        return step, views

    paged_step, views = stepper(paged)
    slot_step, _ = stepper(slot)
    q = torch.randn(batch, c.num_heads, 1, c.head_dim)
    k_new = torch.randn(batch, c.num_kv_heads, 1, c.head_dim)
    v_new = torch.randn_like(k_new)
    gathered = [kv.update(k_new, v_new) for kv in views]
    contiguous = [(k.contiguous(), v.contiguous()) for k, v in gathered]

    def gather_all() -> None:
        for kv in views:  # each result freed before the next, as in a real step
            kv.update(k_new, v_new)

    def attend_all(kvs: list[tuple[Tensor, Tensor]]) -> None:
        for k, v in kvs:
            F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **paged.attn_kwargs)

    t = {
        "bound": kv_bytes / bandwidth,
        "gather": best_seconds(gather_all, REPS) / n,
        "sdpa": best_seconds(lambda: attend_all(gathered), REPS) / n,
        "contig": best_seconds(lambda: attend_all(contiguous), REPS) / n,
    }
    run = profiled_run(paged_step)
    t["in step"] = run["gather"] / c.num_layers
    t["paged"], t["gather share"] = run["wall"], run["gather"] / run["wall"]
    t["sys"], t["faulted"] = run["sys"], run["faulted"]
    t["slot"] = profiled_run(slot_step)["wall"]
    return t


def measure_fresh(batch: int, ctx: int, bandwidth: float) -> dict:
    """`measure` in a new process: whether the allocator hands the gather fresh pages depends on
    the heap's history, so each row gets a heap of its own, independent of the rows before."""
    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(measure, (batch, ctx, bandwidth))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ctx", type=int, nargs="+", default=[128, 512, 1024, 2048])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    args = p.parse_args()
    bandwidth = copy_bandwidth(torch.device("cpu"))
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s, {torch.get_num_threads()} threads")
    per_layer = ["bound", "gather", "in step", "sdpa", "contig"]
    step = ["paged", "slot"]
    heads = ["ctx", "batch", "KV MB", *per_layer, *step, "gather %", "sys ms", "fault MB"]
    print(f"{'':>27}{'ms per layer':^45}{'step ms':^18}")
    print("".join(f"{h:>9}" for h in heads))
    for ctx in args.ctx:
        for batch in args.batch:
            t = measure_fresh(batch, ctx, bandwidth)
            cells = [str(ctx), str(batch), f"{t['bound'] * bandwidth / 1e6:.1f}"]
            cells += [f"{1e3 * t[k]:.2f}" for k in per_layer]
            cells += [f"{1e3 * t[k]:.1f}" for k in step]
            cells += [
                f"{t['gather share']:.0%}",
                f"{1e3 * t['sys']:.0f}",
                f"{t['faulted'] / 1e6:.0f}",
            ]
            print("".join(f"{c:>9}" for c in cells))


if __name__ == "__main__":
    main()
