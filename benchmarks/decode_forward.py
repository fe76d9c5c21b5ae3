"""Time the default model's forward pass at one decode row, and its fixed cost over no tokens.

The forward pass (the layers and the final norm, without the LM head) of one decode row after a
128-token prompt, as the engine runs it, median of many calls; and the same pass over a step of
no tokens, where every layer's ops are called with nothing to compute: the cost of the calls
alone (Python, torch's dispatcher, allocations), which a busy machine's noise hides less than
the whole pass. Meant for A/B runs of two checkouts, alternated, each with its own
TORCH_EXTENSIONS_DIR; the script reads whichever tinyllm PYTHONPATH names:

    cd A && TORCH_EXTENSIONS_DIR=/tmp/ext-a PYTHONPATH=. python PATH/TO/decode_forward.py
    cd B && TORCH_EXTENSIONS_DIR=/tmp/ext-b PYTHONPATH=. python PATH/TO/decode_forward.py
"""

import argparse
import dataclasses
import statistics
import time

import torch

from tinyllm import LLM, SamplingParams
from tinyllm.engine.scheduler import step_message
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
    args = p.parse_args()
    engine = LLM().engine
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
        embed.forward = lambda ids: hidden
        zero = median_us(lambda: model(none, none, empty_ctx), args.reps)
    print(
        f"forward, median of {args.reps} (wall/CPU): one decode row {one[0] / 1e3:.3f}/"
        f"{one[1] / 1e3:.3f} ms, no tokens {zero[0]:.0f}/{zero[1]:.0f} us "
        f"({torch.get_num_threads()} threads)"
    )


if __name__ == "__main__":
    main()
