"""Time a model's forward pass and LM head at one decode row, and the pass's fixed cost.

The forward pass (the layers and the final norm, without the LM head) of one decode row after a
128-token prompt, as the engine runs it, median of many calls; the LM head on that row; and the
forward pass over a step of no tokens, where every layer's ops are called with nothing to
compute: the cost of the calls alone (Python, torch's dispatcher, allocations), which a busy
machine's noise hides less than the whole pass. The default model unless --model names another
(with --load-format dummy, a real shape with random weights: `--model llama-3.2-1b`); the
weights each part reads, and at what rate, are printed with the times. Meant for A/B runs of two
checkouts, alternated, each with its own TORCH_EXTENSIONS_DIR; the script reads whichever
tinyllm PYTHONPATH names:

    cd A && TORCH_EXTENSIONS_DIR=/tmp/ext-a PYTHONPATH=. python PATH/TO/decode_forward.py
    cd B && TORCH_EXTENSIONS_DIR=/tmp/ext-b PYTHONPATH=. python PATH/TO/decode_forward.py
"""

import argparse
import dataclasses
import statistics
import time

import torch

from tinyllm import LLM, SamplingParams
from tinyllm.engine.sched.scheduler import step_message
from tinyllm.entrypoints.bench.offline import weight_bytes_per_token
from tinyllm.model.attention import AttentionMetadata


def median_us(fn, reps: int) -> tuple[float, float]:
    """Median wall and CPU time of this thread per call, us. Under OMP_NUM_THREADS=1 every op
    runs on this thread, and its CPU time leaves out the waits for a core on a busy machine."""
    wall, cpu = [], []
    for _ in range(reps):
        start, start_cpu = time.perf_counter(), time.thread_time()
        fn()
        cpu.append(time.thread_time() - start_cpu)
        wall.append(time.perf_counter() - start)
    return statistics.median(wall) * 1e6, statistics.median(cpu) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=2000, help="calls timed per measurement")
    p.add_argument("--model", default=None, help="a model path or named config (default: SmolLM2)")
    p.add_argument("--load-format", default="auto", help="dummy: random weights of --model's shape")
    args = p.parse_args()
    engine = LLM(args.model, load_format=args.load_format).engine
    rid = engine.add_request(list(range(100, 228)), SamplingParams(max_tokens=8, ignore_eos=True))
    for _ in range(2):  # the prompt, then a decode: the next token's block is allocated
        engine.step()
    batch = engine.runner.prepare_inputs(step_message([(engine.requests[rid], 1)]))
    model = engine.runner.model
    none = torch.empty(0, dtype=torch.long)
    meta = AttentionMetadata(
        none, none.view(0, 1), none, torch.zeros(1, dtype=torch.long), 0, [], []
    )
    empty_ctx = dataclasses.replace(batch.ctx, meta=meta)  # the runner's choices, no tokens
    hidden = torch.zeros(0, model.config.hidden_size, dtype=model.dtype)
    # The quantized embedding does not take zero ids; the layers are what is measured.
    embed = model.model.embed_tokens
    with torch.inference_mode():
        one = median_us(lambda: model(batch.input_ids, batch.positions, batch.ctx), args.reps)
        last = model(batch.input_ids, batch.positions, batch.ctx)
        head = median_us(lambda: model.logits(last), args.reps)
        embed.forward = lambda ids: hidden
        zero = median_us(lambda: model(none, none, empty_ctx), args.reps)
    head_bytes = sum(t.numel() * t.element_size() for t in model.lm_head.state_dict().values())
    layer_bytes = weight_bytes_per_token(model) - head_bytes
    print(
        f"median of {args.reps} (wall/CPU), {torch.get_num_threads()} threads: forward at one "
        f"decode row {one[0] / 1e3:.3f}/{one[1] / 1e3:.3f} ms ({layer_bytes / 2**20:.0f} MiB, "
        f"{layer_bytes / one[0] / 1e3:.1f} GB/s), LM head {head[0] / 1e3:.3f}/"
        f"{head[1] / 1e3:.3f} ms ({head_bytes / 2**20:.0f} MiB, {head_bytes / head[0] / 1e3:.1f} "
        f"GB/s), forward over no tokens {zero[0]:.0f}/{zero[1]:.0f} us"
    )


if __name__ == "__main__":
    main()
