"""What verifying k draft tokens costs: an engine step whose B decoding rows each carry k drafts,
against the same step without drafts, in one run (settings interleaved step by step, so drift
in a shared machine's speed hits them alike).

Speculation pays when a step of B rows of 1 + k tokens costs little more than B rows of 1: the
step is bound by reading the weights. This finds where that stops (the `max_batch` of
speculative_config, and a sensible num_speculative_tokens): tokens gained per step must beat
the ratio printed here.

    PYTHONPATH=. python benchmarks/spec_verify_cost.py --threads 1
    PYTHONPATH=. python benchmarks/spec_verify_cost.py --model llama-3.2-1b --load-format dummy
"""

import argparse
import random
import statistics
import time

from tinyllm import LLM, SamplingParams
from tinyllm.engine.config import EngineConfig
from tinyllm.engine.engine import LLMEngine


class RandomDrafts:
    """k random tokens per request, in place of the speculator's drafts: rejected (nearly
    always), so every step verifies k + 1 tokens a row and then rolls k back; the context grows
    by one token a step, as decoding."""

    def __init__(self, vocab: int):
        self.k, self.vocab, self.rng = 0, vocab, random.Random(0)

    def __call__(self, request) -> list[int]:
        return [self.rng.randrange(100, self.vocab - 100) for _ in range(self.k)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--context", type=int, default=512, help="prompt tokens per row")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--drafts", type=int, nargs="+", default=[0, 1, 2, 4, 6, 8, 12])
    p.add_argument("--steps", type=int, default=12, help="timed steps per setting")
    args = p.parse_args()
    llm = LLM(args.model, load_format=args.load_format, threads=args.threads)
    vocab = llm.engine.model.config.vocab_size
    rng = random.Random(1)
    print(f"context {args.context} tokens per row; ms per engine step (median of {args.steps})")
    print("| rows | " + " | ".join(f"k={k}" for k in args.drafts) + " |")
    print("|---|" + "---|" * len(args.drafts))
    for batch in args.batch:
        config = EngineConfig(
            speculative_config={"num_speculative_tokens": 16, "max_batch": batch},
            max_num_seqs=batch,
            max_num_batched_tokens=max(512, batch * 17),
        )
        engine = LLMEngine(llm.engine.model, llm.tokenizer, config)
        drafts = RandomDrafts(vocab)
        engine.speculator._drafts = drafts
        params = SamplingParams(max_tokens=100_000, temperature=0, ignore_eos=True)
        for _ in range(batch):
            prompt = [rng.randrange(100, vocab - 100) for _ in range(args.context)]
            engine.add_request(None, params, prompt_token_ids=prompt)
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running):
            engine.step()
        engine.step()  # warm: the first step of each shape allocates
        times = {k: [] for k in args.drafts}
        for _ in range(args.steps):
            for k in args.drafts:
                drafts.k = k
                t = time.perf_counter()
                engine.step()
                times[k].append(time.perf_counter() - t)
        base = statistics.median(times[args.drafts[0]])
        cells = [
            f"{1e3 * statistics.median(times[k]):.1f} ({statistics.median(times[k]) / base:.2f}x)"
            for k in args.drafts
        ]
        print(f"| {batch} | " + " | ".join(cells) + " |", flush=True)
        for request_id in list(engine.requests):
            engine.abort(request_id)


if __name__ == "__main__":
    main()
