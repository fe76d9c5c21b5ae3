"""`tinyllm bench WORKLOAD`: tinyllm against a baseline and the machine's limits, in one run.

The machines are shared and noisy, so absolute numbers drift from run to run; the ratios against
a baseline and against the machine's own GEMM rate, all measured in the same process, do not.
The baseline is Hugging Face transformers on the same weights in fp32, static batches of 16
left-padded prompts: what a user gets without an inference engine.

On CPU cores that other work keeps busy, run with OMP_NUM_THREADS=1: a thread pool whose
threads wait for each other at every op is then many times slower (docs/INFERENCE.md).
"""

import argparse
import importlib.util
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from tinyllm.engine.sampling_params import SamplingParams
from tinyllm.entrypoints.args import build_llm
from tinyllm.entrypoints.workloads import Request, check_workload, make_requests
from tinyllm.loaders.source import resolve_model
from tinyllm.model.llama import Transformer

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from tinyllm.entrypoints.llm import LLM

BASELINE_BATCH = 16
INSTALL_BASELINE = "pip install -e '.[test]'"


@dataclass
class Run:
    engine: str
    requests: int
    prompt_tokens: int
    output_tokens: int
    seconds: float

    @property
    def output_rate(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def total_rate(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.seconds


def _run(engine: str, requests: list[Request], seconds: float) -> Run:
    prompt = sum(len(r.prompt_token_ids) for r in requests)
    output = sum(r.max_tokens for r in requests)
    return Run(engine, len(requests), prompt, output, seconds)


# -- the machine's limits ------------------------------------------------------


def best_seconds(fn: Callable[[], object], reps: int = 5) -> float:
    """The fastest of a few timed calls after one warm-up: on a shared machine the minimum is
    the run least disturbed by other work."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _synced(fn: Callable[[], object], device: torch.device) -> Callable[[], None]:
    """fn, waiting for the device to finish it (CUDA kernels run asynchronously)."""

    def call() -> None:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return call


def gemm_flops(device: torch.device, n: int = 2048) -> float:
    """Peak fp32 matmul rate in FLOP/s, from a large square torch.mm."""
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    return 2 * n**3 / best_seconds(_synced(lambda: a @ b, device))


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 28) -> float:
    """Bytes per second a large copy reads (and writes): the rate any streaming read is
    bound by."""
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return nbytes / best_seconds(_synced(lambda: dst.copy_(src), device))


def workload_flops(model: Transformer, requests: list[Request]) -> float:
    """FLOPs the workload needs, whatever the engine: 2 x params per token for the linear layers
    (every token but the last generated one passes through them), 2 x the LM head per generated
    token, and QK^T plus PV against each token's own context. Padding is not counted."""
    c = model.config
    linears = [m for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear)]
    layer_params = sum(m.weight.numel() for m in linears)
    head = model.lm_head.weight.numel()
    attn_per_key = 4 * c.num_layers * c.num_heads * c.head_dim
    total = 0
    for r in requests:
        n = len(r.prompt_token_ids) + r.max_tokens - 1  # tokens fed through the layers
        total += 2 * layer_params * n + 2 * head * r.max_tokens + attn_per_key * n * (n + 1) // 2
    return total


# -- the engines ---------------------------------------------------------------


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
    return _run("tinyllm", requests, seconds)


def load_transformers(model: str | None, device: torch.device) -> "PreTrainedModel":
    """The same weights through transformers, fp32 (the loaded GGUF is dequantized)."""
    missing = [
        m for m in ("transformers", "accelerate", "gguf") if importlib.util.find_spec(m) is None
    ]
    if missing:
        raise ValueError(
            f"the transformers baseline needs {', '.join(missing)}: install it with "
            f"`{INSTALL_BASELINE}`, or pass --baseline none"
        )
    from transformers import AutoModelForCausalLM

    path = resolve_model(model)
    if path.suffix == ".gguf":
        hf = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        )
    else:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return hf.to(device).eval()


def _hf_generate(hf: "PreTrainedModel", batch: list[Request]) -> None:
    L = max(len(r.prompt_token_ids) for r in batch)
    ids = torch.zeros(len(batch), L, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(batch):
        n = len(r.prompt_token_ids)
        ids[i, L - n :] = torch.tensor(r.prompt_token_ids)
        mask[i, L - n :] = 1
    # A static batch runs until its longest request is done; the rest is wasted work.
    n_new = max(r.max_tokens for r in batch)
    dev = hf.device
    hf.generate(
        input_ids=ids.to(dev),
        attention_mask=mask.to(dev),
        max_new_tokens=n_new,
        min_new_tokens=n_new,
        do_sample=False,
        pad_token_id=0,
    )


def run_transformers(hf: "PreTrainedModel", requests: list[Request]) -> Run:
    _hf_generate(hf, [Request(requests[0].prompt_token_ids, 2)])
    bar = tqdm(total=len(requests), desc="transformers", unit="req")
    t = time.perf_counter()
    for i in range(0, len(requests), BASELINE_BATCH):
        batch = requests[i : i + BASELINE_BATCH]
        _hf_generate(hf, batch)
        bar.update(len(batch))
    if hf.device.type == "cuda":
        torch.cuda.synchronize(hf.device)
    seconds = time.perf_counter() - t
    bar.close()
    return _run("transformers", requests, seconds)


# -- the command -----------------------------------------------------------------


_COLUMNS = [
    "engine",
    "requests",
    "out tok",
    "wall s",
    "out tok/s",
    "total tok/s",
    "GFLOP/s",
    "% peak",
]


def _row(cells: list[str]) -> str:
    return f"{cells[0]:<22}" + "".join(f"{c:>12}" for c in cells[1:])


def _table(runs: list[Run], flops: float, peak: float) -> str:
    lines = [_row(_COLUMNS)]
    for r in runs:
        rate = flops / r.seconds
        cells = [r.engine, str(r.requests), str(r.output_tokens), f"{r.seconds:.1f}"]
        cells += [f"{r.output_rate:.1f}", f"{r.total_rate:.1f}", f"{rate / 1e9:.1f}"]
        lines.append(_row(cells + [f"{100 * rate / peak:.1f}%"]))
    if len(runs) == 2:
        a, b = runs
        ratios = [f"{a.output_rate / b.output_rate:.2f}x", f"{a.total_rate / b.total_rate:.2f}x"]
        lines.append(_row([f"{a.engine}/{b.engine}", "", "", ""] + ratios))
    return "\n".join(lines)


def run_bench(args: argparse.Namespace) -> None:
    check_workload(args.workload, args.num_requests)  # before a minute of model loading
    llm = build_llm(args)
    model = llm.engine.model
    device = model.lm_head.weight.device
    hf = load_transformers(args.model, device) if args.baseline != "none" else None
    requests = make_requests(args.workload, model.config.vocab_size, args.seed, args.num_requests)
    peak, bandwidth = gemm_flops(device), copy_bandwidth(device)
    runs = [run_tinyllm(llm, requests)]
    if hf is not None:
        runs.append(run_transformers(hf, requests))
    flops = workload_flops(model, requests)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(
        f"\nworkload {args.workload}: {len(requests)} requests, seed {args.seed}, "
        f"{runs[0].prompt_tokens} prompt + {runs[0].output_tokens} output tokens, "
        f"{flops / 1e12:.2f} TFLOP"
    )
    print(
        f"machine: {device.type}, {torch.get_num_threads()} threads, "
        f"fp32 GEMM {peak / 1e9:.1f} GFLOP/s, copy {bandwidth / 1e9:.1f} GB/s "
        f"(single-stream decode bound: {weight_bytes / 2**20:.0f} MiB of weights per token, "
        f"{bandwidth / weight_bytes:.0f} tok/s)"
    )
    print(_table(runs, flops, peak))
