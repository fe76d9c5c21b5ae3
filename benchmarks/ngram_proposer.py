"""The n-gram proposer's cost per call (it runs once per decoding request per step), at 1k and
4k tokens of context:

- `random`: ids over the default model's vocabulary, so the last token rarely recurs;
- `text-like`: ids over 64 tokens, so the last token recurs every ~64 places and most steps
  find a short match (more than real text, where the commonest token is a few %);
- `runs`: ids over 2 tokens, the worst case: every n-gram up to the longest has occurred.

`step`: a request's call each step, one token more than the last, its index kept (what the
engine does); `first`: the first call, which indexes the whole context (once per request).

`--in-engine`: the calls the engine makes on `single` sampled at temperature 1 (speculation
on, one thread), timed where they run: between steps that stream the weights through the
caches, which costs a call several times what it costs in a warm loop.

    PYTHONPATH=. python benchmarks/ngram_proposer.py
    PYTHONPATH=. python benchmarks/ngram_proposer.py --in-engine
"""

import argparse
import random
import statistics
import time
import timeit

from tinyllm import LLM, SamplingParams
from tinyllm.engine.spec_decode.ngram_proposer import NgramProposer
from tinyllm.entrypoints.workloads import make_requests

CASES = {"random": 49152, "text-like": 64, "runs": 2}


def per_step(proposer: NgramProposer, context: list[int], more: list[int]) -> float:
    """Seconds per call over `more` tokens appended one at a time, each followed by a call."""
    tokens, index = list(context), proposer.new_index()
    proposer.propose(tokens, None, index)
    seconds = -timeit.default_timer()
    for token in more:
        tokens.append(token)
        proposer.propose(tokens, None, index)
    return (seconds + timeit.default_timer()) / len(more)


def in_engine(repeats: int) -> None:
    seconds: list[float] = []
    propose = NgramProposer.propose

    def timed(self: NgramProposer, *args, **kwargs) -> list[int]:
        start = time.perf_counter()
        drafts = propose(self, *args, **kwargs)
        seconds.append(time.perf_counter() - start)
        return drafts

    NgramProposer.propose = timed
    llm = LLM(threads=1, speculative_config={"method": "ngram"})
    (request,) = make_requests("single", llm.engine.model.config.vocab_size, 0, None)
    print(f"single, temperature 1: {len(request.prompt_token_ids)} prompt tokens")
    for seed in range(repeats):
        seconds.clear()
        start = time.perf_counter()
        params = SamplingParams(
            temperature=1.0, seed=seed, max_tokens=request.max_tokens, ignore_eos=request.ignore_eos
        )
        llm.generate([request.prompt_token_ids], params, use_tqdm=False)
        wall = time.perf_counter() - start
        print(
            f"seed {seed}: {len(seconds)} calls, {1e6 * statistics.fmean(seconds):.1f} us a call "
            f"(median {1e6 * statistics.median(seconds):.1f}, first {1e6 * seconds[0]:.0f}), "
            f"{sum(seconds) / wall:.2%} of the run's {wall:.1f} s"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--min", type=int, default=2, help="prompt_lookup_min")
    parser.add_argument("--max", type=int, default=5, help="prompt_lookup_max")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--in-engine", type=int, nargs="?", const=3, default=0, metavar="REPEATS")
    args = parser.parse_args()
    if args.in_engine:
        in_engine(args.in_engine)
        return
    proposer = NgramProposer(args.k, args.min, args.max)
    rng = random.Random(0)
    print(f"k={args.k}, n-grams of {args.min}..{args.max}: microseconds per call")
    print(f"{'context':>8} {'tokens':>10} {'step':>8} {'first':>8}")
    for n in (1024, 4096):
        for case, alphabet in CASES.items():
            tokens = [rng.randrange(alphabet) for _ in range(n + args.calls)]
            context, more = tokens[:n], tokens[n:]
            step = min(per_step(proposer, context, more) for _ in range(3))
            first = min(timeit.repeat(lambda c=context: proposer.propose(c), number=5, repeat=3))
            print(f"{n:>8} {case:>10} {step * 1e6:8.1f} {first / 5 * 1e6:8.0f}")


if __name__ == "__main__":
    main()
