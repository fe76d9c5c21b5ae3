"""Time the engine on a long prompt and on offline-small's requests, the default configuration.

Seconds of `LLMEngine.step()` until done (no prefix cache, so every run computes everything):
one 2000-token prompt with one token to generate (mostly prefill), and 16 requests of
U[32, 256] prompt and U[16, 128] output tokens. Two rounds after a warm-up. Meant for A/B runs
of two checkouts in one session, each with its own TORCH_EXTENSIONS_DIR so that each builds
its own kernels:

    TORCH_EXTENSIONS_DIR=/tmp/ext-a python benchmarks/prefill_time.py   # in checkout A
    TORCH_EXTENSIONS_DIR=/tmp/ext-b python benchmarks/prefill_time.py   # in checkout B
"""

import random
import time

from tinyllm import LLM, SamplingParams
from tinyllm.engine.config import EngineConfig
from tinyllm.engine.engine import LLMEngine


def main() -> None:
    llm = LLM(num_blocks=600, max_model_len=4096)
    rng = random.Random(0)
    config = EngineConfig(num_blocks=600, max_model_len=4096, enable_prefix_caching=False)

    def run(prompts: list[list[int]], params: list[SamplingParams]) -> float:
        engine = LLMEngine(llm.engine.model, llm.tokenizer, config)
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            engine.add_request(None, sp, request_id=str(i), prompt_token_ids=p)
        start = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        return time.perf_counter() - start

    long = [[rng.randrange(100, 49000) for _ in range(2000)]]
    one = [SamplingParams(max_tokens=1, temperature=0)]
    small = [[rng.randrange(100, 49000) for _ in range(rng.randint(32, 256))] for _ in range(16)]
    small_params = [
        SamplingParams(max_tokens=rng.randint(16, 128), temperature=0, ignore_eos=True)
        for _ in small
    ]
    run(long, one)  # warm-up
    for _ in range(2):
        print(
            f"prefill 2000: {run(long, one):.2f} s  offline-small: {run(small, small_params):.2f} s"
        )


if __name__ == "__main__":
    main()
