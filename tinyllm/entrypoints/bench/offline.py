"""`tinyllm bench WORKLOAD`: tinyllm against a baseline and the machine's limits, in one run.

The machines are shared and noisy, so absolute numbers drift from run to run; the ratios against
a baseline and against the machine's own GEMM rate, all measured in the same process, do not.

On CPU cores that other work keeps busy, run with --threads 1 (or OMP_NUM_THREADS=1): a thread
pool whose threads wait for each other at every op is then many times slower
(docs/MEASUREMENTS.md, "Threads on a busy machine").
"""

import argparse
import copy
import dataclasses
import itertools
import statistics
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from tinyllm.engine.engine import LLMEngine
from tinyllm.engine.outputs import RequestOutput
from tinyllm.engine.sampling_params import SamplingParams
from tinyllm.engine.spec_decode.speculator import SpecStats
from tinyllm.engine.structured_output.grammar import GrammarStats
from tinyllm.engine.structured_output.params import StructuredOutputsParams
from tinyllm.entrypoints.args import build_llm, engine_options
from tinyllm.entrypoints.bench.baseline import BASELINE_BATCH, load_transformers, run_transformers
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
from tinyllm.entrypoints.workloads import (
    STRUCTURED_SCHEMAS,
    WORKLOADS,
    Request,
    check_workload,
    make_requests,
)
from tinyllm.model.config import ModelConfig
from tinyllm.model.llama import Transformer
from tinyllm.model.moe import SparseMoE
from tinyllm.model.quant import describe_weights

if TYPE_CHECKING:
    from tinyllm.entrypoints.llm import LLM


def workload_flops(c: ModelConfig, requests: list[Request]) -> float:
    """FLOPs the workload needs, whatever the engine: 2 x params per token for the linear layers
    (every token but the last generated one passes through them; of a mixture-of-experts layer,
    the router and the experts a token runs), 2 x the LM head per generated token, and QK^T plus
    PV against each token's own context. Padding is not counted."""
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    attention = c.hidden_size * (2 * q + 2 * kv)
    dense_ffn = 3 * c.hidden_size * c.intermediate_size
    moe_ffn = c.hidden_size * (c.num_experts + 3 * c.num_experts_per_tok * c.moe_intermediate_size)
    layer_params = sum(
        attention + (moe_ffn if c.is_moe_layer(i) else dense_ffn) for i in range(c.num_layers)
    )
    head = c.vocab_size * c.hidden_size
    attn_per_key = 4 * c.num_layers * c.num_heads * c.head_dim
    total = 0
    for r in requests:
        n = len(r.prompt_token_ids) + r.max_tokens - 1  # tokens fed through the layers
        total += 2 * layer_params * n + 2 * head * r.max_tokens + attn_per_key * n * (n + 1) // 2
    return total


def _bytes(module: torch.nn.Module) -> int:
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def weight_bytes_per_token(model: Transformer) -> int:
    """The weight bytes one decode step of one token reads, as stored (dense, int8 or packed
    int4): every parameter and buffer but an untied embedding table, of which a step reads one
    row a token, and of each mixture-of-experts layer's experts only the token's top-k."""
    total = _bytes(model)
    embed = model.model.embed_tokens
    if not model.config.tie_word_embeddings and isinstance(embed, torch.nn.Embedding):
        total -= embed.weight.numel() * embed.weight.element_size()
    c = model.config
    for moe in (m for m in model.modules() if isinstance(m, SparseMoE)):
        idle = 1 - c.num_experts_per_tok / c.num_experts
        total -= round(idle * _bytes(moe.experts))
    return total


def _params(
    max_tokens: int,
    constraint: StructuredOutputsParams | None = None,
    ignore_eos: bool = True,
    temperature: float = 0.0,
) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        ignore_eos=ignore_eos,
        structured_outputs=constraint,
    )


class EngineRun:
    """Drives an engine to the end, noting each request's time to first token, the prefix
    cache's hits and what constrained decoding cost. The warm-up (under the same constraint, so
    the tokenizer's grammar tables are built before the clock starts) leaves the cache empty, so
    every run starts cold."""

    def __init__(
        self,
        engine: "LLMEngine",
        warmup: Request,
        constraint: StructuredOutputsParams | None,
        temperature: float = 0.0,
    ) -> None:
        self.engine, self.constraint, self.temperature = engine, constraint, temperature
        engine.add_request(warmup.prompt_token_ids, _params(2, constraint), "warmup")
        for _ in engine.outputs():
            pass
        engine.reset_prefix_cache()
        self._stats = engine.stats()
        self._grammar = engine.grammar_stats()
        self._spec = self._stats.spec_decode
        self.submitted: dict[str, float] = {}
        self.ttft: dict[str, float] = {}

    def add(self, request_id: str, request: Request) -> None:
        params = _params(request.max_tokens, self.constraint, request.ignore_eos, self.temperature)
        self.engine.add_request(request.prompt_token_ids, params, request_id)
        self.submitted[request_id] = time.perf_counter()

    def run(self, on_finished: Callable[[RequestOutput], None] = lambda out: None) -> None:
        for outputs in self.engine.outputs():
            for out in outputs:
                if out.request_id not in self.ttft and out.token_ids:
                    self.ttft[out.request_id] = time.perf_counter() - self.submitted[out.request_id]
                if out.finished:
                    on_finished(out)

    @property
    def hit_rate(self) -> float | None:
        now, then = self.engine.stats(), self._stats
        queried = now.prefix_cache_queries - then.prefix_cache_queries
        return (now.prefix_cache_hits - then.prefix_cache_hits) / queried if queried else None

    @property
    def spec(self) -> SpecStats | None:
        """Speculative decoding's drafts in this run; None when the engine has it off."""
        now = self.engine.spec_stats()
        return None if now is None else now - self._spec

    @property
    def grammar(self) -> GrammarStats | None:
        """Constrained decoding's cost in this run; None for an unconstrained one."""
        return None if self.constraint is None else self.engine.grammar_stats() - self._grammar


def run_tinyllm(
    llm: "LLM",
    requests: list[Request],
    name: str = "tinyllm",
    constraint: StructuredOutputsParams | None = None,
    max_concurrency: int | None = None,
    temperature: float = 0.0,
) -> tuple[Run, list[Request]]:
    """The run, and the requests as made, each with the number of tokens it made and EOS
    ignored (what a baseline then runs): under a constraint a request ends where its grammar
    does, one that stops at EOS where its EOS is, at most at its max_tokens; else it makes
    them all. At most `max_concurrency` requests in flight (None: all at once); the next is
    sent as one finishes. `temperature` 0: greedy."""
    bench = EngineRun(llm.engine, requests[0], constraint, temperature)
    pending = iter(enumerate(requests))
    made = {}

    def on_finished(out: RequestOutput) -> None:
        made[out.request_id] = len(out.token_ids)
        for i, r in itertools.islice(pending, 1):
            bench.add(str(i), r)

    t = time.perf_counter()
    for i, r in itertools.islice(pending, max_concurrency):
        bench.add(str(i), r)
    bench.run(on_finished)
    seconds = time.perf_counter() - t
    for i, r in enumerate(requests):
        exact = constraint is None and r.ignore_eos
        if made[str(i)] > r.max_tokens or (exact and made[str(i)] != r.max_tokens):
            raise RuntimeError(f"tinyllm made {made[str(i)]} tokens, asked {r.max_tokens}")
    requests = [Request(r.prompt_token_ids, made[str(i)]) for i, r in enumerate(requests)]
    ttft = statistics.fmean(bench.ttft.values())
    run = measured(name, requests, seconds, ttft=ttft, hit_rate=bench.hit_rate, spec=bench.spec)
    return dataclasses.replace(run, grammar=bench.grammar), requests


def run_chat_replay(
    llm: "LLM",
    conversations: list[list[Request]],
    name: str = "tinyllm",
    temperature: float = 0.0,
) -> tuple[Run, list[Request]]:
    """Every conversation's turns in order, all conversations at once: a turn is sent when the
    previous one's answer is in, its prompt the conversation so far plus its new tokens. Returns
    the run and the requests as sent (whole prompts), for the token and FLOP counts."""
    bench = EngineRun(llm.engine, conversations[0][0], None, temperature)
    sent: list[Request] = []
    history = [[] for _ in conversations]

    def send(c: int, turn: int) -> None:
        new = conversations[c][turn]
        request = Request(history[c] + new.prompt_token_ids, new.max_tokens)
        sent.append(request)
        bench.add(f"{c}-{turn}", request)

    def on_finished(out: RequestOutput) -> None:
        c, turn = map(int, out.request_id.split("-"))
        history[c] = list(out.prompt_token_ids) + list(out.token_ids)
        if turn + 1 < len(conversations[c]):
            send(c, turn + 1)

    t = time.perf_counter()
    for c in range(len(conversations)):
        send(c, 0)
    bench.run(on_finished)
    seconds = time.perf_counter() - t
    turns = len(conversations[0])
    by_turn = tuple(
        statistics.fmean(bench.ttft[f"{c}-{turn}"] for c in range(len(conversations)))
        for turn in range(turns)
    )
    ttft = statistics.fmean(bench.ttft.values())
    run = measured(
        name, sent, seconds, ttft=ttft, hit_rate=bench.hit_rate, ttft_by_turn=by_turn,
        spec=bench.spec,
    )  # fmt: skip
    return run, sent


def _phase(message: str) -> None:
    # stderr, so stdout stays the results; a phase can take minutes on a busy machine.
    print(f"bench: {message}", file=sys.stderr, flush=True)


def fresh_engine(llm: "LLM", **changes: object) -> "LLM":
    """The same model behind a fresh engine, its config with `changes`. A baseline runs on
    one, so that it too starts with a pool whose pages the OS has yet to map, as the first run
    did: the first touch of the KV pages is part of what a run costs. Tensor-parallel workers
    stay, and build a fresh runner too."""
    other = copy.copy(llm)
    engine, llm.engine = llm.engine, None
    other.engine = engine.with_config(**changes)
    return other


def without_prefix_caching(llm: "LLM") -> "LLM":
    return fresh_engine(llm, enable_prefix_caching=False)


def baseline_for(
    workload: str,
    baseline: str,
    structured: str | None = None,
    dummy: bool = False,
    speculative: bool = False,
) -> str:
    """--baseline auto: with --structured the same run unconstrained; with
    --speculative-config the same run without speculation; else tinyllm without prefix
    caching where the workload is about the cache, else transformers (none for `dummy`
    weights, which transformers cannot load). A chat replay has no transformers baseline and no
    constraint; only a constrained run has an unconstrained baseline, and it has no other (it
    ends requests early)."""
    if baseline == "no-speculation" and not speculative:
        raise ValueError("--baseline no-speculation needs --speculative-config (what to turn off)")
    if speculative and structured is None and baseline == "auto":
        return "no-speculation"
    chat = WORKLOADS[workload].turns > 1
    if structured is not None:
        if chat:
            raise ValueError(f"--structured runs single-turn workloads, not {workload}'s chats")
        if baseline not in ("auto", "unconstrained", "none"):
            raise ValueError(
                f"--structured compares with the same run unconstrained, not {baseline}: "
                "--baseline auto, unconstrained or none"
            )
        return "unconstrained" if baseline == "auto" else baseline
    if baseline == "unconstrained":
        raise ValueError("--baseline unconstrained needs --structured (what to constrain)")
    about_cache = workload in ("shared-prefix", "multi-turn")
    if dummy and baseline == "transformers":
        raise ValueError("--baseline transformers needs the model's real weights, not dummy ones")
    if baseline == "auto":
        return "no-prefix-caching" if about_cache else ("none" if dummy else "transformers")
    if baseline == "transformers" and chat:
        raise ValueError(f"--baseline transformers cannot replay {workload}'s chats: use auto")
    return baseline


def run_bench(args: argparse.Namespace) -> None:
    # Before a minute of model loading.
    check_workload(args.workload, args.num_requests, args.max_concurrency)
    dummy = args.load_format == "dummy"
    speculative = args.speculative_config is not None
    baseline = baseline_for(args.workload, args.baseline, args.structured, dummy, speculative)
    constraint = None
    if args.structured is not None:
        constraint = StructuredOutputsParams(json=STRUCTURED_SCHEMAS[args.structured])
    workload = WORKLOADS[args.workload]
    turns = workload.turns
    if turns > 1 and args.max_concurrency is not None:
        raise ValueError(
            f"--max-concurrency runs single-turn workloads, not {args.workload}'s chats"
        )
    max_concurrency = args.max_concurrency or workload.max_concurrency
    _phase(f"loading tinyllm ({args.model or 'the default model'})")
    llm = build_llm(args)
    # Read now: a baseline's fresh engine replaces llm's, and the old one must go.
    model_config = llm.engine.model_config
    device = llm.engine.apply_model(lambda model: model.device)
    weight_bytes = llm.engine.apply_model(weight_bytes_per_token)
    weights = llm.engine.apply_model(describe_weights)
    hf = None
    if baseline == "transformers":
        _phase("loading the transformers baseline (same weights, fp32)")
        hf = load_transformers(args.model, device)
    requests = make_requests(
        args.workload, model_config.vocab_size, args.seed, args.num_requests, llm.tokenizer
    )
    conversations = [requests[i : i + turns] for i in range(0, len(requests), turns)]
    _phase(f"measuring the machine: fp32 GEMM rate and read bandwidth ({device.type})")
    machine = measure_machine(device)

    def run(
        llm: "LLM", name: str, constraint: StructuredOutputsParams | None = None
    ) -> tuple[Run, list[Request]]:
        """The run, and its requests as made (a chat replay's turns with their histories)."""
        if turns == 1:
            return run_tinyllm(llm, requests, name, constraint, max_concurrency, args.temperature)
        return run_chat_replay(llm, conversations, name, args.temperature)

    what = f"{len(conversations)} conversations" if turns > 1 else f"{len(requests)} requests"
    if turns == 1 and max_concurrency is not None:
        what += f", at most {max_concurrency} at once"
    under = f", every output JSON under a schema ({args.structured})" if constraint else ""
    _phase(f"running tinyllm: {args.workload}, {what}{under}, {threads(machine.threads)}")
    first, sent = run(llm, f"tinyllm {args.structured}" if constraint else "tinyllm", constraint)
    runs = [first]
    if turns == 1:
        # The baselines do the same work: the same prompts, each making as many tokens as it
        # made in the first run (where it ended at EOS or its JSON did), with EOS ignored. Greedy
        # output does not depend on the engine's settings (speculation on or off makes the same
        # tokens), so a tinyllm baseline makes the very same tokens; transformers' fp32 weights
        # may choose others, but as many.
        requests = sent
    if baseline == "unconstrained":
        _phase(f"running the baseline: tinyllm unconstrained, {threads(machine.threads)}")
        runs.append(run(fresh_engine(llm), "unconstrained")[0])
    elif hf is not None:
        _phase(f"running the baseline: transformers, {threads(machine.threads)}")
        runs.append(run_transformers(hf, requests, max_concurrency or BASELINE_BATCH))
    elif baseline == "no-speculation":
        _phase(f"running the baseline: tinyllm without speculation, {threads(machine.threads)}")
        runs.append(run(fresh_engine(llm, speculative_config=None), "no-speculation")[0])
    elif baseline == "no-prefix-caching":
        _phase(f"running the baseline: tinyllm without prefix caching, {threads(machine.threads)}")
        runs.append(run(without_prefix_caching(llm), "no-prefix-caching")[0])
    result = OfflineResult(
        workload=args.workload,
        seed=args.seed,
        runs=runs,
        flops=workload_flops(model_config, sent),
        weight_bytes=weight_bytes,
        weights=weights,
        machine=machine,
        engine_args=engine_options(args),
        max_concurrency=max_concurrency if turns == 1 else None,
        temperature=args.temperature,
    )
    print("\n" + summary(result))
    if args.json:
        write_json(result, args.json)
    if args.plot:
        plot(result, args.plot)
