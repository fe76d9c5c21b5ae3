"""How many sequences one KV budget runs at once: the slot cache against the paged cache.

Same model, same requests (a mixed-length workload, offline-small's lengths by default), the
same bytes of K and V for both caches. The slot cache reserves max_model_len tokens for every
sequence it admits; the paged cache hands out blocks as sequences grow. Sampled after every
engine step:

    running    sequences in the batch (max and mean over steps)
    used       tokens actually stored in the cache
    allocated  tokens held for running sequences (a slot's whole length, or whole blocks)
    reserved   the cache's capacity: the budget, in tokens

Run: python benchmarks/kv_memory.py [--budget-tokens 2048] [--max-model-len 512]
"""

import argparse
import statistics

from engine_run import Trace, drive

from tinyllm import LLM
from tinyllm.engine.engine import EngineConfig, LLMEngine
from tinyllm.entrypoints.workloads import WORKLOADS, make_requests


def row(name: str, capacity: str, t: Trace, same: str) -> str:
    running = [s.stats.num_running for s in t.steps]
    used = sum(s.used_tokens for s in t.steps)
    allocated = sum(s.allocated_tokens for s in t.steps)
    n = len(t.steps)
    out_tokens = sum(len(ids) for ids in t.outputs.values())
    cells = [
        capacity,
        str(t.steps[0].reserved_tokens),
        str(max(running)),
        f"{statistics.mean(running):.1f}",
        f"{used / n:.0f}",
        f"{allocated / n:.0f}",
        f"{used / allocated:.0%}",
        str(n),
        f"{t.seconds:.1f}",
        f"{out_tokens / t.seconds:.1f}",
        str(t.final.num_preemptions),
        same,
    ]
    return f"{name:<7}" + "".join(f"{c:>11}" for c in cells)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workload", default="offline-small", choices=WORKLOADS)
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget-tokens", type=int, default=2048, help="the KV budget, in tokens")
    p.add_argument("--max-model-len", type=int, default=512, help="what a slot reserves")
    args = p.parse_args()

    # Only the loaded model is kept (num_blocks=1: no memory wasted on this engine's cache);
    # each cache gets its own engine around it.
    llm = LLM(max_model_len=args.max_model_len, num_blocks=1)
    model, tokenizer = llm.engine.model, llm.tokenizer
    c = model.config
    per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * model.lm_head.weight.element_size()
    budget = args.budget_tokens * per_token
    requests = make_requests(args.workload, c.vocab_size, args.seed, args.num_requests)

    traces = {}
    for kind in ("slot", "paged"):
        cfg = EngineConfig(kv_cache=kind, kv_cache_memory=budget, max_model_len=args.max_model_len)
        traces[kind] = drive(LLMEngine(model, tokenizer, cfg), requests, kind)
    slot, paged = traces["slot"].outputs, traces["paged"].outputs
    same = sum(slot[r] == paged[r] for r in slot)

    print(
        f"\n{args.workload}, {len(requests)} requests, KV budget {args.budget_tokens} tokens "
        f"({budget / 2**20:.0f} MiB), max_model_len {args.max_model_len}"
    )
    heads = ["capacity", "reserved", "max run", "mean run", "used", "allocated", "used/alloc"]
    heads += ["steps", "wall s", "out tok/s", "preempted", "same toks"]
    print(f"{'cache':<7}" + "".join(f"{h:>11}" for h in heads))
    bs = EngineConfig().block_size
    slots = traces["slot"].steps[0].reserved_tokens // args.max_model_len
    blocks = traces["paged"].steps[0].reserved_tokens // bs
    print(row("slot", f"{slots} slots", traces["slot"], "-"))
    print(row("paged", f"{blocks} blocks", traces["paged"], f"{same}/{len(slot)}"))


if __name__ == "__main__":
    main()
