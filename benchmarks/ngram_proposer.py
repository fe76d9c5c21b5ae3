"""The n-gram proposer's cost per call (it runs once per running request per step), at 1k and
4k tokens of context, given a Python list (converted on every call) and a numpy array:

- `random`: ids over the default model's vocabulary, so the last token rarely recurs;
- `text-like`: ids over 64 tokens, so the last token recurs every ~64 places and many partial
  matches are followed back (costlier than real text, where the commonest token is a few %);
- `runs`: ids over 2 tokens, the worst case: half the context are candidates.

    PYTHONPATH=. python benchmarks/ngram_proposer.py
"""

import argparse
import random
import timeit

import numpy as np

from tinyllm.engine.ngram_proposer import NgramProposer

CASES = {"random": 49152, "text-like": 64, "runs": 2}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--min", type=int, default=2, help="prompt_lookup_min")
    parser.add_argument("--max", type=int, default=5, help="prompt_lookup_max")
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    proposer = NgramProposer(args.k, args.min, args.max)
    rng = random.Random(0)
    print(f"k={args.k}, n-grams of {args.min}..{args.max}: microseconds per call")
    print(f"{'context':>8} {'tokens':>10} {'list':>8} {'ndarray':>8}")
    for n in (1024, 4096):
        for case, alphabet in CASES.items():
            tokens = [rng.randrange(alphabet) for _ in range(n)]
            array = np.array(tokens, dtype=np.int64)
            per_call = []
            for given in (tokens, array):
                best = min(
                    timeit.repeat(lambda g=given: proposer.propose(g), number=args.calls, repeat=3)
                )
                per_call.append(best / args.calls * 1e6)
            print(f"{n:>8} {case:>10} {per_call[0]:8.1f} {per_call[1]:8.1f}")


if __name__ == "__main__":
    main()
