"""What a chat's history costs a turn's prefill: one engine step that prefills 8 requests of 56
new tokens each after H tokens already in the prefix cache, for H from 0 to 1024 (the step a
multi-turn replay's turn 10 runs). The default configuration; the best of three per H. Run it
in two checkouts for an A/B (`PYTHONPATH=.` and a TORCH_EXTENSIONS_DIR each, so each runs and
builds its own code):

    PYTHONPATH=. TORCH_EXTENSIONS_DIR=/tmp/ext-a python benchmarks/history_prefill.py --threads 1
"""

import argparse
import random
import time

from tinyllm import LLM, SamplingParams

ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--new", type=int, default=56)
    args = parser.parse_args()
    engine = LLM(threads=args.threads).engine
    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(n)]

    def run(prompts: list[list[int]], tag: str) -> float:
        for i, p in enumerate(prompts):
            engine.add_request(None, ONE_TOKEN, request_id=f"{tag}{i}", prompt_token_ids=p)
        start = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        return time.perf_counter() - start

    for history in (0, 256, 512, 768, 1024):
        best = float("inf")
        for rep in range(3):
            engine.reset_prefix_cache()
            histories = [tokens(history) for _ in range(args.rows)]
            if history:
                run(histories, f"h{history}-{rep}-")  # now in the prefix cache
            turn = [h + tokens(args.new) for h in histories]
            best = min(best, run(turn, f"t{history}-{rep}-"))
        print(f"H {history:5d}: {args.rows} x {args.new} new tokens in {best * 1000:7.1f} ms")


if __name__ == "__main__":
    main()
