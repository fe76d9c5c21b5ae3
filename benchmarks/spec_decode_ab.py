"""Speculative decoding on and off, interleaved: the same requests on two engines over one
model, alternating which runs first, so that a shared machine's changing speed hits both alike
(`tinyllm bench --speculative-config` runs one engine after the other, which on a busy machine
can move the ratio by 20%).

Single-stream workloads (grounded, single) alternate request by request; batched ones
(offline, offline-small) alternate whole runs; `--rounds` repeats it all. Prints each side's output
tokens/s and the ratio, and the drafts accepted.

    PYTHONPATH=. python benchmarks/spec_decode_ab.py grounded --threads 1
    PYTHONPATH=. python benchmarks/spec_decode_ab.py single --temperature 1 --rounds 4
    PYTHONPATH=. python benchmarks/spec_decode_ab.py offline
"""

import argparse
import copy
import dataclasses
import json

from tinyllm import LLM
from tinyllm.engine.engine import LLMEngine
from tinyllm.engine.speculative import SpecStats
from tinyllm.entrypoints.bench.offline import run_tinyllm
from tinyllm.entrypoints.workloads import WORKLOADS, make_requests


def with_config(llm: LLM, speculative_config: dict | None) -> LLM:
    other = copy.copy(llm)
    config = dataclasses.replace(llm.engine.config, speculative_config=speculative_config)
    other.engine = LLMEngine(llm.engine.model, llm.tokenizer, config)
    return other


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("workload", choices=list(WORKLOADS))
    p.add_argument("--speculative-config", default='{"method": "ngram"}')
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--rounds", type=int, default=1, help="times each side runs the workload")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    llm = LLM(threads=args.threads)
    spec = json.loads(args.speculative_config)
    sides = {"on": with_config(llm, spec), "off": with_config(llm, None)}
    requests = make_requests(
        args.workload, llm.engine.model.config.vocab_size, args.seed, args.num_requests,
        llm.tokenizer,
    )  # fmt: skip
    single = args.workload in ("grounded", "single")
    batches = ([[r] for r in requests] if single else [requests]) * args.rounds
    seconds, tokens = dict.fromkeys(sides, 0.0), dict.fromkeys(sides, 0)
    drafts = SpecStats()
    for i, batch in enumerate(batches):
        order = ["on", "off"] if i % 2 == 0 else ["off", "on"]
        for side in order:
            run, made = run_tinyllm(sides[side], batch, side, temperature=args.temperature)
            seconds[side] += run.seconds
            tokens[side] += run.output_tokens
            if run.spec is not None:
                drafts += run.spec
            batch[:] = made  # what it made, EOS ignored: the other side makes as many
    print(f"workload {args.workload}, {len(requests)} requests, temperature {args.temperature}, "
          f"speculative_config {spec}")  # fmt: skip
    for side in sides:
        print(f"  {side:>3}: {tokens[side]} tokens in {seconds[side]:.1f} s, "
              f"{tokens[side] / seconds[side]:.1f} tok/s")  # fmt: skip
    ratio = (tokens["on"] / seconds["on"]) / (tokens["off"] / seconds["off"])
    print(f"  on/off: {ratio:.2f}x output tokens/s")
    accepted = drafts.num_accepted_tokens / max(drafts.num_draft_tokens, 1)
    print(f"  drafts: {drafts.num_drafts} rows verified, {drafts.num_accepted_tokens} of "
          f"{drafts.num_draft_tokens} tokens accepted ({accepted:.0%}), mean acceptance length "
          f"{drafts.mean_acceptance_length:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
