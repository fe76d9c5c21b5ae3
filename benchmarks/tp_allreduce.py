"""What tensor parallelism adds to a forward pass on the CPU: the all-reduces, over gloo.

Under tensor parallelism each decoder layer sums two (rows, hidden) matrices over the ranks,
o_proj's and down_proj's partial outputs, so a forward pass makes 2 x num_layers of them. The
model does it with `reduce_in_rank_order` (model/tensor_parallel.py: an all-gather, then the
parts added in rank order, for bits that do not depend on the batch); gloo's own all-reduce is
timed beside it. One call on a decode step's hidden states (one row by default) between
`--world-size` processes on this host, each with one thread, for the default model's shape and
a 1B one; prints the median per call and per forward pass:

    python benchmarks/tp_allreduce.py [--world-size 2] [--rows 1] [--calls 2000]
"""

import argparse
import itertools
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tinyllm.model.tensor_parallel import reduce_in_rank_order

# name: (hidden size, decoder layers)
SHAPES = {"SmolLM2-135M": (576, 30), "Llama-3.2-1B": (2048, 16)}
TRIALS = 5
REDUCTIONS = {"reduce_in_rank_order": reduce_in_rank_order, "gloo all_reduce": dist.all_reduce}


def _rank(rank: int, args: argparse.Namespace, port: int) -> None:
    torch.set_num_threads(1)
    url = f"tcp://127.0.0.1:{port}"
    dist.init_process_group("gloo", init_method=url, rank=rank, world_size=args.world_size)
    try:
        for (name, (hidden, layers)), (how, reduce) in itertools.product(
            SHAPES.items(), REDUCTIONS.items()
        ):
            x = torch.randn(args.rows, hidden)
            for _ in range(args.calls // 10):  # warm up: connections, buffers
                reduce(x)
            per_call = []
            for _ in range(TRIALS):
                dist.barrier()
                start = time.perf_counter()
                for _ in range(args.calls):
                    reduce(x)
                per_call.append((time.perf_counter() - start) / args.calls * 1e6)
            us = statistics.median(per_call)
            if rank == 0:
                print(
                    f"{name}: {args.rows} x {hidden} fp32, world_size {args.world_size}, {how}: "
                    f"{us:.1f} us per call (trials {min(per_call):.1f}-{max(per_call):.1f}), "
                    f"{2 * layers} per forward pass = {2 * layers * us / 1000:.2f} ms"
                )
    finally:
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2, help="processes (ranks)")
    p.add_argument("--rows", type=int, default=1, help="rows of hidden states per all-reduce")
    p.add_argument("--calls", type=int, default=2000, help="all-reduces timed per trial")
    args = p.parse_args()
    with socket.socket() as s:  # a free port for the ranks to meet on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(args, port), nprocs=args.world_size)


if __name__ == "__main__":
    main()
