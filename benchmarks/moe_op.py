"""The mixture-of-experts op (model/moe_ops.cpp, moe_experts) with tokens grouped by expert,
against a loop that runs the same op one token at a time, at Qwen3-30B-A3B's MoE layer shape:
hidden 2048, 128 experts of intermediate 768, top 8, int4 weights (random codes and fp16
scales, packed as model/quant.py packs them: 377 MB for the layer's experts).

Grouped, a step reads each active expert's weights once however many of its tokens chose it;
the loop reads them once per token that chose them. Each repetition routes the tokens afresh
(top 8 of a softmax over random logits, renormalised: every expert equally likely, where a
trained router favours some, so reuse is at its lowest in expectation), and reads a buffer
larger than the caches before each timed call, so the experts' weights come from memory, as a
model's 48 such layers' would. Printed
per step size: active experts, expert reuse (slots per active expert), milliseconds for the
grouped op and for the loop (best of --reps), their ratio, and the grouped op's best rate over
the active experts' weight bytes, against the read bandwidth measured in the same run.

Run: python benchmarks/moe_op.py [--tokens 1 4 16 64] [--reps 5] [--threads 2]
"""

import argparse
import time
from functools import partial

import torch

from tinyllm.entrypoints.bench.machine import read_bandwidth
from tinyllm.model.cpu_library import library_error
from tinyllm.model.quant import GROUP, GroupQuantized, pack

HIDDEN, EXPERTS, INTERMEDIATE, TOP_K = 2048, 128, 768, 8


def random_int4(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Packed int4 records of random codes with fp16 scales and offsets, as a GGUF file's."""
    scale = (torch.rand(n, k // GROUP, generator=gen) * 0.002 + 1e-4).half().float()
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    return pack(GroupQuantized(q, scale, (-8 * scale).half().float(), bits=4))


def route(tokens: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.randn(tokens, EXPERTS, generator=gen).softmax(-1)
    weights, ids = probs.topk(TOP_K, dim=-1)
    return ids, weights / weights.sum(-1, keepdim=True)


def grouped(x, ids, weights, gate_up, down) -> None:
    torch.ops.tinyllm.moe_experts(x, ids, weights, gate_up, down, INTERMEDIATE)


def per_token(x, ids, weights, gate_up, down) -> None:
    for t in range(len(x)):
        row = slice(t, t + 1)
        torch.ops.tinyllm.moe_experts(x[row], ids[row], weights[row], gate_up, down, INTERMEDIATE)


def cold_seconds(fn, flush: torch.Tensor) -> float:
    """One call's time after reading `flush`, which evicts the caches' weights."""
    flush.sum()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@torch.inference_mode()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if error := library_error():
        raise SystemExit(f"tinyllm's CPU kernels did not load: {error}")
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    gate_up = [random_int4(2 * INTERMEDIATE, HIDDEN, gen) for _ in range(EXPERTS)]
    down = [random_int4(HIDDEN, INTERMEDIATE, gen) for _ in range(EXPERTS)]
    expert_bytes = gate_up[0].numel() + down[0].numel()
    flush = torch.ones(1 << 28)  # 1 GiB: more than any cache
    bandwidth = read_bandwidth(torch.device("cpu"))
    print(
        f"threads {torch.get_num_threads()}, read bandwidth {bandwidth / 1e9:.1f} GB/s, "
        f"{expert_bytes / 1e6:.2f} MB an expert, {EXPERTS * expert_bytes / 1e6:.0f} MB the layer"
    )
    print("tokens  active  reuse  grouped ms  loop ms  loop/grouped  grouped GB/s (% of read)")
    for tokens in args.tokens:
        x = torch.randn(tokens, HIDDEN, generator=gen)
        best_grouped = best_loop = float("inf")
        active, rate = [], 0.0
        for _ in range(args.reps):  # a fresh routing each time, the same for both
            ids, weights = route(tokens, gen)
            active.append(len(ids.unique()))
            step = (x, ids, weights, gate_up, down)
            seconds = cold_seconds(partial(grouped, *step), flush)
            best_grouped = min(best_grouped, seconds)
            rate = max(rate, active[-1] * expert_bytes / seconds)
            best_loop = min(best_loop, cold_seconds(partial(per_token, *step), flush))
        mean_active = sum(active) / len(active)
        print(
            f"{tokens:>6}  {mean_active:>6.1f}  {tokens * TOP_K / mean_active:>5.2f}  "
            f"{best_grouped * 1e3:>10.2f}  {best_loop * 1e3:>7.2f}  "
            f"{best_loop / best_grouped:>12.2f}  {rate / 1e9:>6.1f} ({rate / bandwidth:.0%})"
        )


if __name__ == "__main__":
    main()
