"""Decode at a long context: the int8 K/V cache against the model's dtype (bf16), one stream.

One model (`--model`, a named real shape with dummy weights, int4) and two engines on it, one per
cache dtype, each holding one request of a `--ctx`-token prompt (random ids) that decodes
without end. Both prompts are prefilled first; then the engines take turns, `--steps` decode
steps each per round, `--rounds` rounds, so that other work on a shared machine slows both alike.
Printed per round: each engine's ms per step and their ratio; then the median ratio.

Run: python benchmarks/kv_int8_decode.py [--model llama-3.2-1b] [--ctx 8192] [--threads 2]
"""

import argparse
import statistics
import time

import torch

from tinyllm import LLM, SamplingParams
from tinyllm.engine.config import EngineConfig
from tinyllm.engine.engine import LLMEngine


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="llama-3.2-1b")
    p.add_argument("--ctx", type=int, default=8192)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    max_len = args.ctx + args.steps * args.rounds + 16
    llm = LLM(args.model, load_format="dummy", num_blocks=8, max_model_len=max_len)
    model = llm.engine.model
    prompt = torch.randint(100, 30000, (args.ctx,), generator=torch.Generator().manual_seed(0))
    params = SamplingParams(max_tokens=max_len - args.ctx, temperature=0, ignore_eos=True)
    engines = {}
    for dtype in ("auto", "int8"):
        config = EngineConfig(
            kv_cache_dtype=dtype, num_blocks=-(-max_len // 16), max_model_len=max_len
        )
        engine = LLMEngine(model, llm.tokenizer, config)
        engine.add_request(None, params, request_id="0", prompt_token_ids=prompt.tolist())
        start = time.perf_counter()
        while not any(o.outputs[0].token_ids for o in engine.step()):
            pass  # prefill chunks, until the prompt's first token is out
        print(f"{dtype}: prefilled {args.ctx} tokens in {time.perf_counter() - start:.0f} s")
        engines[dtype] = engine
    name = f"{model.dtype}".removeprefix("torch.")
    ratios = []
    for r in range(args.rounds):
        ms = {}
        for dtype, engine in engines.items():
            start = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            ms[dtype] = 1e3 * (time.perf_counter() - start) / args.steps
        ratios.append(ms["auto"] / ms["int8"])
        print(f"round {r}: {name} cache {ms['auto']:.1f} ms/step, int8 {ms['int8']:.1f}, "
              f"int8 faster by {ratios[-1]:.2f}x")  # fmt: skip
    print(f"{args.model}, {args.ctx} context, {args.threads} threads: median "
          f"{statistics.median(ratios):.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
