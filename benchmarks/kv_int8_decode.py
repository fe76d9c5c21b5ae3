"""Decode attention at a long context: the int8 K/V cache against bf16, one stream, every layer.

The attention of one decode step of a model shape (`--shape`: Llama-3.2-1B's by default, 16
layers, 32 query heads, 8 KV heads, head_dim 64), its one row `--ctx` tokens long, blocks of 16
shuffled over the pool, each layer its own caches (so K and V come from memory, as in a real
step): the CPU kernel over bf16 caches, then over int8 caches holding the same K and V
quantized. The two take turns, `--rounds` times; printed: each one's best ms per step, the
bytes of K and V each reads, and the ratio. The rest of a decode step (the weights, which at 1B
read 862 MiB in int4) does not change with the cache, so this is the part the cache dtype buys.

Run: python benchmarks/kv_int8_decode.py [--ctx 8192] [--threads 1] [--shape 16,32,8,64]
"""

import argparse
import dataclasses
import math
import time

import torch

from benchmarks.decode_attention import step_metadata
from tinyllm.model.attention.backend import AttentionBackend
from tinyllm.model.attention.cpu import load_cpu_backend
from tinyllm.model.attention.int8_cache import row_width


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ctx", type=int, default=8192)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--shape", default="16,32,8,64", help="layers,heads,kv_heads,head_dim")
    args = p.parse_args()
    layers, hq, hkv, d = (int(x) for x in args.shape.split(","))
    torch.set_num_threads(args.threads)
    backend, why = load_cpu_backend()
    if backend is None:
        raise SystemExit(why)
    gen = torch.Generator().manual_seed(0)
    meta = step_metadata([args.ctx], [1], gen)
    blocks = int(meta.block_tables.max()) + 1
    q = torch.randn(1, hq, d, generator=gen).to(torch.bfloat16)
    caches = {"bf16": [], "int8": []}
    all_slots = torch.arange(blocks * 16)  # every slot: the whole context written
    full = dataclasses.replace(meta, slot_mapping=all_slots)
    for _ in range(layers):
        k = torch.randn(blocks * 16, hkv, d, generator=gen).to(torch.bfloat16)
        v = torch.randn(blocks * 16, hkv, d, generator=gen).to(torch.bfloat16)
        for name, dtype in (("bf16", torch.bfloat16), ("int8", torch.int8)):
            shape = (blocks, 16, hkv, row_width(d, dtype))
            kc, vc = torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype)
            AttentionBackend.write(k, v, kc, vc, full)
            caches[name].append((kc, vc))

    def step(name: str) -> None:
        for kc, vc in caches[name]:
            backend.attend(q, None, None, kc, vc, meta, d**-0.5)

    best = {name: math.inf for name in caches}
    for name in caches:
        step(name)  # warm-up
    for _ in range(args.rounds):
        for name in caches:
            start = time.perf_counter()
            step(name)
            best[name] = min(best[name], time.perf_counter() - start)
    for name, per_layer in caches.items():
        kc = per_layer[0][0]
        read = 2 * layers * args.ctx * hkv * kc.shape[-1] * kc.element_size()
        print(f"{name}: {1e3 * best[name]:.1f} ms a step, K and V {read / 2**20:.0f} MiB")
    print(f"{args.shape} at {args.ctx} tokens, {args.threads} thread(s): int8 "
          f"{best['bf16'] / best['int8']:.2f}x bf16's speed")  # fmt: skip


if __name__ == "__main__":
    main()
