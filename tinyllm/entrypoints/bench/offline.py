"""`tinyllm bench WORKLOAD`: tinyllm against a baseline and the machine's limits, in one run.

The machines are shared and noisy, so absolute numbers drift from run to run; the ratios against
a baseline and against the machine's own GEMM rate, all measured in the same process, do not.

On CPU cores that other work keeps busy, run with --threads 1 (or OMP_NUM_THREADS=1): a thread
pool whose threads wait for each other at every op is then many times slower (docs/INFERENCE.md).
"""

import argparse
import sys
import time
from typing import TYPE_CHECKING

import torch

from tinyllm.engine.sampling_params import SamplingParams
from tinyllm.entrypoints.args import build_llm, engine_options
from tinyllm.entrypoints.bench.baseline import load_transformers, run_transformers
from tinyllm.entrypoints.bench.machine import measure_machine
from tinyllm.entrypoints.bench.report import (
    OfflineResult,
    Run,
    measured,
    plot,
    summary,
    threads,
    write_json,
)
from tinyllm.entrypoints.workloads import Request, check_workload, make_requests
from tinyllm.model.llama import Transformer
from tinyllm.model.quant import describe_weights

if TYPE_CHECKING:
    from tinyllm.entrypoints.llm import LLM


def workload_flops(model: Transformer, requests: list[Request]) -> float:
    """FLOPs the workload needs, whatever the engine: 2 x params per token for the linear layers
    (every token but the last generated one passes through them), 2 x the LM head per generated
    token, and QK^T plus PV against each token's own context. Padding is not counted."""
    c = model.config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_layer = c.hidden_size * (2 * q + 2 * kv) + 3 * c.hidden_size * c.intermediate_size
    layer_params = c.num_layers * per_layer
    head = c.vocab_size * c.hidden_size
    attn_per_key = 4 * c.num_layers * c.num_heads * c.head_dim
    total = 0
    for r in requests:
        n = len(r.prompt_token_ids) + r.max_tokens - 1  # tokens fed through the layers
        total += 2 * layer_params * n + 2 * head * r.max_tokens + attn_per_key * n * (n + 1) // 2
    return total


def weight_bytes_per_token(model: Transformer) -> int:
    """The weight bytes one decode step reads, as stored (dense, int8 or packed int4): every
    parameter and buffer but an untied embedding table, of which a step reads one row a token."""
    tensors = [*model.parameters(), *model.buffers()]
    total = sum(t.numel() * t.element_size() for t in tensors)
    embed = model.model.embed_tokens
    if not model.config.tie_word_embeddings and isinstance(embed, torch.nn.Embedding):
        total -= embed.weight.numel() * embed.weight.element_size()
    return total


def run_tinyllm(llm: "LLM", requests: list[Request]) -> Run:
    params = [
        SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True) for r in requests
    ]
    prompts = [r.prompt_token_ids for r in requests]
    warmup = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    llm.generate([prompts[0]], [warmup], use_tqdm=False)
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - t
    for r, o in zip(requests, outs, strict=True):
        if len(o.token_ids) != r.max_tokens:
            raise RuntimeError(f"tinyllm made {len(o.token_ids)} tokens, asked {r.max_tokens}")
    return measured("tinyllm", requests, seconds)


def _phase(message: str) -> None:
    # stderr, so stdout stays the results; a phase can take minutes on a busy machine.
    print(f"bench: {message}", file=sys.stderr, flush=True)


def run_bench(args: argparse.Namespace) -> None:
    check_workload(args.workload, args.num_requests)  # before a minute of model loading
    _phase(f"loading tinyllm ({args.model or 'the default model'})")
    llm = build_llm(args)
    model = llm.engine.model
    device = model.device
    hf = None
    if args.baseline != "none":
        _phase("loading the transformers baseline (same weights, fp32)")
        hf = load_transformers(args.model, device)
    requests = make_requests(args.workload, model.config.vocab_size, args.seed, args.num_requests)
    _phase(f"measuring the machine: fp32 GEMM rate and copy bandwidth ({device.type})")
    machine = measure_machine(device)
    _phase(
        f"running tinyllm: {args.workload}, {len(requests)} requests, {threads(machine.threads)}"
    )
    runs = [run_tinyllm(llm, requests)]
    if hf is not None:
        _phase(f"running the baseline: transformers, {threads(machine.threads)}")
        runs.append(run_transformers(hf, requests))
    result = OfflineResult(
        workload=args.workload,
        seed=args.seed,
        runs=runs,
        flops=workload_flops(model, requests),
        weight_bytes=weight_bytes_per_token(model),
        weights=describe_weights(model),
        machine=machine,
        engine_args=engine_options(args),
    )
    print("\n" + summary(result))
    if args.json:
        write_json(result, args.json)
    if args.plot:
        plot(result, args.plot)
