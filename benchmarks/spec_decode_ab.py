"""Speculative decoding on and off, interleaved: the same requests on two engines over one
model, alternating which runs first, so that a shared machine's changing speed hits both alike
(`tinyllm bench --speculative-config` runs one engine after the other, which on a busy machine
can move the ratio by 20%).

Single-stream workloads (grounded, single) alternate request by request; batched ones
(offline, offline-small) alternate whole runs; `--rounds` repeats it all. With `--by-step` a
single stream's request runs on both sides at once, one engine step each in turn, each side's
clock counting its own steps only: a busy machine's load, which moves over seconds, then hits
both alike (2026-12-02, load 5-7 on 2 cores: each round's on/off ratio of `single` sampled
within 0.90-1.06 by step, against 0.56-1.35 request by request). But stepping two engines in
turn slows one-row steps (bound by streaming the weights) more than verified rows: with
speculation off on both sides each side made 79 tok/s by step against 98 one engine after the
other, so `--by-step` reads `grounded`, where the sides' steps differ most, high (1.95x against
1.7-1.8x request by request, docs/MEASUREMENTS.md, "Speculative decoding"). Use it where both
sides run one-row steps
(`single` sampled). Prints each side's output tokens/s and the ratio, and the drafts accepted.

    PYTHONPATH=. python benchmarks/spec_decode_ab.py grounded --threads 1
    PYTHONPATH=. python benchmarks/spec_decode_ab.py single --temperature 1 --rounds 4
    PYTHONPATH=. python benchmarks/spec_decode_ab.py single --temperature 1 --rounds 4 --by-step
    PYTHONPATH=. python benchmarks/spec_decode_ab.py offline
"""

import argparse
import copy
import dataclasses
import itertools
import json
import time

from tinyllm import LLM, SamplingParams
from tinyllm.engine.engine import LLMEngine
from tinyllm.engine.spec_decode.speculator import SpecStats
from tinyllm.entrypoints.bench.offline import run_tinyllm
from tinyllm.entrypoints.workloads import WORKLOADS, Request, make_requests


def with_config(llm: LLM, speculative_config: dict | None) -> LLM:
    other = copy.copy(llm)
    config = dataclasses.replace(llm.engine.config, speculative_config=speculative_config)
    other.engine = LLMEngine(llm.engine.model, llm.tokenizer, config)
    return other


def by_request(
    sides: dict[str, LLM], batches: list[list[Request]], temperature: float
) -> tuple[dict[str, float], dict[str, int], SpecStats]:
    """Each batch on one side, then the other (who goes first alternates). Returns seconds,
    output tokens and the drafts, per side."""
    seconds, tokens = dict.fromkeys(sides, 0.0), dict.fromkeys(sides, 0)
    drafts = SpecStats()
    for i, batch in enumerate(batches):
        order = ["on", "off"] if i % 2 == 0 else ["off", "on"]
        for side in order:
            run, made = run_tinyllm(sides[side], batch, side, temperature=temperature)
            seconds[side] += run.seconds
            tokens[side] += run.output_tokens
            if run.spec is not None:
                drafts += run.spec
            batch[:] = made  # what it made, EOS ignored: the other side makes as many
    return seconds, tokens, drafts


def by_step(
    sides: dict[str, LLM], requests: list[Request], temperature: float
) -> tuple[dict[str, float], dict[str, int], SpecStats]:
    """Each request on every side at once, one step of each engine in turn (who goes first
    alternates); each side's seconds are its own steps'. Returns seconds, output tokens and the
    drafts, per side."""
    engines = {side: llm.engine for side, llm in sides.items()}
    for engine in engines.values():  # warm-up
        engine.add_request(requests[0].prompt_token_ids, SamplingParams(max_tokens=4), "warmup")
        while engine.has_unfinished():
            engine.step()
    before = engines["on"].stats().spec_decode
    seconds, tokens = dict.fromkeys(engines, 0.0), dict.fromkeys(engines, 0)
    turns = itertools.cycle([["on", "off"], ["off", "on"]])
    for i, r in enumerate(requests):
        params = SamplingParams(
            temperature=temperature, max_tokens=r.max_tokens, ignore_eos=r.ignore_eos
        )
        for engine in engines.values():
            engine.add_request(r.prompt_token_ids, params, str(i))
        while any(engine.has_unfinished() for engine in engines.values()):
            for side in next(turns):
                if engines[side].has_unfinished():
                    t = time.perf_counter()
                    outputs = engines[side].step()
                    seconds[side] += time.perf_counter() - t
                    tokens[side] += sum(len(o.token_ids) for o in outputs if o.finished)
    return seconds, tokens, engines["on"].stats().spec_decode - before


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("workload", choices=list(WORKLOADS))
    p.add_argument("--speculative-config", default='{"method": "ngram"}')
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--rounds", type=int, default=1, help="times each side runs the workload")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--by-step",
        action="store_true",
        help="single streams: both sides step the same request in turn (module docstring: "
        "it reads grounded high)",
    )
    args = p.parse_args()
    llm = LLM(threads=args.threads)
    spec = json.loads(args.speculative_config)
    sides = {"on": with_config(llm, spec), "off": with_config(llm, None)}
    requests = make_requests(
        args.workload, llm.engine.model.config.vocab_size, args.seed, args.num_requests,
        llm.tokenizer,
    )  # fmt: skip
    single = args.workload in ("grounded", "single")
    if args.by_step and not single:
        p.error(f"--by-step runs single streams (grounded, single), not {args.workload}")
    if args.by_step:
        seconds, tokens, drafts = by_step(sides, requests * args.rounds, args.temperature)
    else:
        batches = ([[r] for r in requests] if single else [requests]) * args.rounds
        seconds, tokens, drafts = by_request(sides, batches, args.temperature)
    print(f"workload {args.workload}, {len(requests)} requests, temperature {args.temperature}, "
          f"speculative_config {spec}")  # fmt: skip
    for side in sides:
        print(f"  {side:>3}: {tokens[side]} tokens in {seconds[side]:.1f} s, "
              f"{tokens[side] / seconds[side]:.1f} tok/s")  # fmt: skip
    ratio = (tokens["on"] / seconds["on"]) / (tokens["off"] / seconds["off"])
    print(f"  on/off: {ratio:.3f}x output tokens/s")
    accepted = drafts.num_accepted_tokens / max(drafts.num_draft_tokens, 1)
    print(f"  drafts: {drafts.num_drafts} rows verified, {drafts.num_accepted_tokens} of "
          f"{drafts.num_draft_tokens} tokens accepted ({accepted:.0%}), mean acceptance length "
          f"{drafts.mean_acceptance_length:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
