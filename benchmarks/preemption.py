"""What preemption costs: the same requests on pools too small to hold them all, and on one big
enough never to preempt.

When a decode step needs a block and none is free, the engine frees the newest sequence's
blocks and later recomputes it (prompt + tokens so far) in a prefill: vLLM's recompute policy.
Greedy outputs must not change, only the time: the script checks every small pool's tokens
against the big pool's. A small pool costs twice: the recomputed prefills, and smaller decode
batches (mean run: sequences per step), since fewer sequences fit at once.

Run: python benchmarks/preemption.py [--pools 32 64 128] [--num-requests 16]
"""

import argparse
import math
import statistics

from engine_run import drive

from tinyllm import LLM
from tinyllm.engine.engine import EngineConfig, LLMEngine
from tinyllm.entrypoints.workloads import WORKLOADS, make_requests


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workload", default="offline-small", choices=WORKLOADS)
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pools", type=int, nargs="+", default=[32, 64, 128], help="sizes in blocks")
    p.add_argument("--max-model-len", type=int, default=512)
    args = p.parse_args()

    # Only the loaded model is kept; each pool gets its own engine around it.
    llm = LLM(max_model_len=args.max_model_len, num_blocks=1)
    model, tokenizer = llm.engine.model, llm.tokenizer
    requests = make_requests(args.workload, model.config.vocab_size, args.seed, args.num_requests)
    bs = EngineConfig().block_size
    # Every request at its full length, all at once: this pool never preempts.
    big = sum(math.ceil((len(r.prompt_token_ids) + r.max_tokens) / bs) for r in requests)

    def run(blocks: int):
        cfg = EngineConfig(num_blocks=blocks, max_model_len=args.max_model_len)
        return drive(LLMEngine(model, tokenizer, cfg), requests, f"{blocks} blocks")

    ref = run(big)
    prompt_tokens = ref.final.prompt_tokens
    rows = []
    for blocks in sorted(args.pools) + [big]:
        t = ref if blocks == big else run(blocks)
        mismatched = [r for r in ref.outputs if t.outputs[r] != ref.outputs[r]]
        assert not mismatched, f"{blocks} blocks: requests {mismatched} changed their tokens"
        s = t.final
        rows.append(
            [
                str(blocks),
                str(blocks * bs),
                str(s.num_preemptions),
                f"{s.num_preemptions / len(t.steps):.2f}",
                str(s.recomputed_tokens),
                f"{s.recomputed_tokens / prompt_tokens:.0%}",
                str(len(t.steps)),
                f"{statistics.mean(x.stats.num_running for x in t.steps):.1f}",
                f"{t.seconds:.1f}",
                f"{t.seconds / ref.seconds:.2f}x",
            ]
        )

    print(
        f"\n{args.workload}, {len(requests)} requests, {prompt_tokens} prompt tokens, "
        f"{sum(r.max_tokens for r in requests)} output tokens; outputs identical in every pool"
    )
    heads = ["blocks", "tokens", "preempted", "per step", "recomputed", "of prompt"]
    heads += ["steps", "mean run", "wall s", "vs big"]
    print("".join(f"{h:>11}" for h in heads))
    for cells in rows:
        print("".join(f"{c:>11}" for c in cells))


if __name__ == "__main__":
    main()
