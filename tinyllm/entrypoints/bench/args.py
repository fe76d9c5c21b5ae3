"""`tinyllm bench`'s command line: one subcommand per offline workload, and `serve`.

Kept apart from the benchmarks themselves so that `tinyllm --help` imports neither torch nor
httpx.
"""

import argparse
import os
from pathlib import Path

from tinyllm.entrypoints.args import add_engine_args, positive_int
from tinyllm.entrypoints.workloads import OFFLINE_WORKLOADS, STRUCTURED_SCHEMAS, WORKLOADS

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
# The default model's; random prompt ids stay below it, so any larger vocabulary works too.
DEFAULT_VOCAB_SIZE = 49152


def cmd_bench(args: argparse.Namespace) -> None:
    from tinyllm.entrypoints.bench.offline import run_bench

    run_bench(args)


def cmd_bench_serve(args: argparse.Namespace) -> None:
    from tinyllm.entrypoints.bench.serve import run_serve

    run_serve(args)


def cmd_bench_embed(args: argparse.Namespace) -> None:
    from tinyllm.entrypoints.bench.embed import run_embed

    run_embed(args)


def _output_path(value: str) -> Path:
    """A file written at the end of the run: its folder is checked now, not after the run."""
    path = Path(value)
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"no folder {path.parent} to write {path.name} in")
    return path


def _offline_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--baseline",
        default="auto",
        choices=[
            "auto",
            "transformers",
            "no-prefix-caching",
            "no-speculation",
            "unconstrained",
            "none",
        ],  # fmt: skip
        help="measured in the same run: HF transformers (fp32, static batches of 16), "
        "tinyllm with prefix caching off, (with --speculative-config) tinyllm without "
        "speculation, or (with --structured) tinyllm unconstrained; auto: unconstrained with "
        "--structured, else no-speculation with --speculative-config, else caching off for "
        "shared-prefix and multi-turn, else transformers",
    )
    p.add_argument(
        "--structured",
        choices=list(STRUCTURED_SCHEMAS),
        default=None,
        help="constrain every request's output: json, a JSON schema (a list of records). A "
        "request ends where its JSON does; the unconstrained baseline then makes the same "
        "number of tokens per request. Reports the time spent on token masks per step "
        "(default: unconstrained)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="tinyllm's runs sample at this temperature (default 0: greedy); the transformers "
        "baseline stays greedy, making as many tokens",
    )
    p.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help="run only the workload's first N requests (grounded: N requests, default 8)",
    )
    p.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="at most N requests in flight; the next is sent as one finishes (default: all at "
        "once; grounded: 1, a single stream). The transformers baseline then runs static "
        "batches of N",
    )
    p.add_argument(
        "--json", metavar="PATH", type=_output_path, help="also write the results as JSON"
    )
    p.add_argument(
        "--plot", metavar="PATH", type=_output_path, help="also draw the throughputs in a PNG"
    )
    add_engine_args(p)


def _serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--workload",
        default="serve",
        choices=["serve", "multi-turn"],
        help="serve: independent requests; multi-turn: the chat replay of `tinyllm bench "
        f"multi-turn` ({WORKLOADS['multi-turn'].summary()}), as text prompts (default: serve)",
    )
    p.add_argument(
        "--base-url",
        default=DEFAULT_BASE_URL,
        type=lambda url: url.rstrip("/"),
        help=f"the OpenAI-compatible server (default: {DEFAULT_BASE_URL})",
    )
    p.add_argument(
        "--model", default=None, help="model name to ask for (default: the server's first)"
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="sent as a bearer token (default: $OPENAI_API_KEY)",
    )
    p.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help="send only the workload's first N requests (multi-turn: N conversations)",
    )
    p.add_argument(
        "--turns",
        type=int,
        default=None,
        help="multi-turn: only each conversation's first N turns (default: all)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and the arrivals")
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests (multi-turn: conversation starts) per second, Poisson arrivals "
        "(default: inf, all at once)",
    )
    p.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="at most this many requests (multi-turn: conversations) in flight; later "
        "arrivals wait (default: no cap)",
    )
    p.add_argument(
        "--output-len",
        type=int,
        default=None,
        help="every request generates this many tokens (default: the workload's lengths)",
    )
    p.add_argument(
        "--long-prompt",
        type=int,
        metavar="N",
        default=None,
        help="once every request is streaming, send one more with an N-token prompt and "
        "report the others' inter-token latency while it is prefilled",
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        default=DEFAULT_VOCAB_SIZE,
        help="prompt token ids are drawn from [100, vocab - 100) "
        f"(default: {DEFAULT_VOCAB_SIZE}, the default model's)",
    )
    p.add_argument(
        "--json", metavar="PATH", type=_output_path, help="also write the results as JSON"
    )


def add_bench_args(b: argparse.ArgumentParser) -> None:
    """`tinyllm bench`'s subcommands, on its parser."""
    workloads = b.add_subparsers(dest="workload", metavar="WORKLOAD", required=True)
    for name in OFFLINE_WORKLOADS:
        w = workloads.add_parser(name, help=WORKLOADS[name].summary())
        _offline_args(w)
        w.set_defaults(func=cmd_bench)
    serve = WORKLOADS["serve"].summary()
    s = workloads.add_parser(
        "serve",
        help=f"online, against a running server: {serve}",
        description=f"The serve workload ({serve}) streamed from a running OpenAI-compatible "
        "server's /v1/completions; reports throughput and TTFT/TPOT/ITL/E2E latency as "
        "`vllm bench serve` does. --workload multi-turn replays chats instead, and reports "
        "TTFT per turn and the prompt tokens the server found in its prefix cache.",
    )
    _serve_args(s)
    s.set_defaults(func=cmd_bench_serve)
    e = workloads.add_parser(
        "embed",
        help="embeddings: texts/s on N texts of 16-256 tokens against sentence-transformers",
        description="Embeds N random texts of 16-256 tokens with a pooling model (an embedding "
        "model, or --pooling on any model) and the same texts with sentence-transformers on "
        "the same checkpoint in the same run: texts/s, the ratio, and the cosine between them.",
    )
    e.add_argument("--num-texts", type=positive_int, default=1000, help="texts to embed")
    e.add_argument("--seed", type=int, default=0, help="draws the texts")
    e.add_argument(
        "--baseline",
        default="sentence-transformers",
        choices=["sentence-transformers", "none"],
        help="measured in the same run on the same HF checkpoint",
    )
    add_engine_args(e)
    e.set_defaults(func=cmd_bench_embed)
