"""What n-gram speculation could gain, before the engine does it: the default model's greedy
outputs on a workload's prompts, replayed through NgramProposer as a speculative run would take
them. At each step the proposer drafts k tokens from the context so far (prompt and output
up to there, capped so that no draft runs past the output's end); greedy verification accepts
the drafts that equal the next greedy tokens, up to the first that does not, and emits one token
of its own; the next step starts after them. So per step: whether there was a proposal, the
accepted length, and accepted + 1 tokens made (the bound on tokens per forward pass; what it
costs to verify k + 1 rows is the engine's question). The last column is tokens per step over
the requests that ended at EOS only: the default model often falls into a loop until its
max_tokens, which n-gram lookup predicts perfectly, so the all-requests figure flatters what a
model that answers well would get. A second table gives, at every output position, how often the
first draft is the next token by the length of the longest match it comes from (when sampling,
how often speculative sampling would accept it): a draft pays when that beats its cost. The
third replays the outputs through the engine's own drafting policy (spec_decode/speculator.py's
Speculator: which requests draft and how many, for each num_speculative_tokens) and models the
speedup over plain decoding with a step of k drafts costing 1 + a x k plain steps (`--draft-cost`
a, what benchmarks/spec_verify_cost.py measures; prefill not counted).

    PYTHONPATH=. python benchmarks/ngram_acceptance.py --workload grounded --num-requests 16
    PYTHONPATH=. python benchmarks/ngram_acceptance.py --workload single
    PYTHONPATH=. python benchmarks/ngram_acceptance.py --workload offline-small --temperature 1
"""

import argparse
import statistics
import time
from dataclasses import dataclass

from tinyllm import LLM, SamplingParams
from tinyllm.engine.config import SpeculativeConfig
from tinyllm.engine.sched.request import Request
from tinyllm.engine.spec_decode.ngram_proposer import NgramProposer
from tinyllm.engine.spec_decode.speculator import Speculator
from tinyllm.entrypoints.workloads import make_requests

KS = (2, 4, 6, 8)
POLICY_KS = (4, 6, 8, 10, 12)
LOOKUPS = ((1, 3), (2, 4), (3, 5))


class EarliestNgramProposer(NgramProposer):
    occurrence = 0  # vLLM's choice, for the comparison


@dataclass
class Replay:
    steps: int = 0
    proposed: int = 0  # steps with a proposal
    drafted: int = 0
    accepted: int = 0
    tokens: int = 0
    seconds: float = 0.0  # in propose()

    def add(self, other: "Replay") -> None:
        for field in self.__dataclass_fields__:
            setattr(self, field, getattr(self, field) + getattr(other, field))


def replay(proposer: NgramProposer, prompt: list[int], output: list[int]) -> Replay:
    r = Replay(tokens=len(output))
    context, index = list(prompt), proposer.new_index()  # as a request keeps them
    i = 0
    while i < len(output):
        context.extend(output[len(context) - len(prompt) : i])
        t = time.perf_counter()
        # The last token is always the target's own (a step makes accepted + 1).
        draft = proposer.propose(context, len(output) - i - 1, index)
        r.seconds += time.perf_counter() - t
        accepted = 0
        while accepted < len(draft) and draft[accepted] == output[i + accepted]:
            accepted += 1
        r.steps += 1
        r.proposed += bool(draft)
        r.drafted += len(draft)
        r.accepted += accepted
        i += accepted + 1
    return r


def replay_policy(
    config: SpeculativeConfig, temperature: float, prompt: list[int], output: list[int]
) -> Replay:
    """One output as the engine's Speculator drafts for it, the request decoding alone: each step
    it drafts from the tokens so far, the drafts equal to the next tokens are accepted and the
    model's own token follows (when sampling: each draft with the chance speculative sampling
    accepts it, as `replay`)."""
    params = SamplingParams(temperature=temperature)
    request = Request("replay", prompt, params, len(output), eos_token_ids=[], seed=0)
    speculator = Speculator(config, max_model_len=len(prompt) + len(output))
    r = Replay(tokens=len(output))
    while request.num_output_tokens < len(output):
        i = request.num_output_tokens
        request.num_computed_tokens = request.num_tokens - 1  # decoding its next token
        t = time.perf_counter()
        speculator.propose([request])
        r.seconds += time.perf_counter() - t
        draft, request.spec_token_ids = request.spec_token_ids, []
        accepted = 0
        while accepted < len(draft) and draft[accepted] == output[i + accepted]:
            accepted += 1
        if draft:
            speculator.record(len(draft), accepted)
        r.steps += 1
        r.proposed += bool(draft)
        r.drafted += len(draft)
        r.accepted += accepted
        request.all_token_ids += output[i : i + accepted + 1]
    return r


def print_policy(
    pairs: list[tuple[list[int], list[int], bool]], temperature: float, draft_cost: float
) -> None:
    """The third table: the engine's policy at each num_speculative_tokens, all requests and
    those that ended at EOS."""
    print(
        f"the engine's drafting policy, a step of k drafts costing 1 + {draft_cost} x k steps:\n"
        f"{'num_spec':>9} {'proposed':>9} {'drafts':>7} {'acc/draft':>9} {'tok/step':>9} "
        f"{'speedup':>8} {'EOS-only':>9} {'speedup':>8}"
    )
    for k in POLICY_KS:
        total, at_eos = Replay(), Replay()
        config = SpeculativeConfig(num_speculative_tokens=k)
        for prompt, output, stopped in pairs:
            one = replay_policy(config, temperature, prompt, output)
            total.add(one)
            if stopped:
                at_eos.add(one)

        def gains(r: Replay) -> str:
            if not r.steps:
                return f"{'-':>9} {'-':>8}"
            speedup = r.tokens / (r.steps + draft_cost * r.drafted)
            return f"{r.tokens / r.steps:9.2f} {speedup:7.3f}x"

        print(
            f"{k:9d} {total.proposed / total.steps:9.1%} {total.drafted / total.steps:7.2f} "
            f"{total.accepted / max(total.drafted, 1):9.1%} {gains(total)} {gains(at_eos)}"
        )


def by_match_length(outputs: list[tuple[list[int], list[int]]], longest: int) -> None:
    """At every output position, the longest suffix match (1..longest) and whether the first
    token it drafts is the next one."""
    exact = [NgramProposer(1, n, n) for n in range(1, longest + 1)]
    anywhere = NgramProposer(1, 1, longest)
    hits, seen = [0] * (longest + 1), [0] * (longest + 1)
    for prompt, output in outputs:
        context = list(prompt)
        indexes = [p.new_index() for p in exact]
        index = anywhere.new_index()
        for token in output:
            # An n-gram match implies shorter ones.
            n = sum(1 for p, ix in zip(exact, indexes, strict=True) if p.propose(context, None, ix))
            if n:
                seen[n] += 1
                hits[n] += anywhere.propose(context, None, index) == [token]
            context.append(token)
    print("first draft is the next token, by the longest match's length:")
    for n in range(1, longest + 1):
        print(f"  {n}: {hits[n]} of {seen[n]} ({hits[n] / max(seen[n], 1):.0%})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="grounded")
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--show", type=int, default=0, help="print the first N outputs")
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sample instead (seeded): a draft then matches the sampled token with probability "
        "p(draft), as speculative sampling accepts it (default: 0, greedy)",
    )
    parser.add_argument(
        "--draft-cost",
        type=float,
        default=0.15,
        help="a step of k drafts costs 1 + a x k plain steps, for the modelled speedup (default: "
        "0.15, benchmarks/spec_verify_cost.py at one row, 2026-12-02)",
    )
    args = parser.parse_args()
    llm = LLM(threads=args.threads)
    requests = make_requests(
        args.workload,
        llm.engine.model.config.vocab_size,
        args.seed,
        args.num_requests,
        tokenizer=llm.tokenizer,
    )
    params = [
        SamplingParams(
            temperature=args.temperature,
            seed=args.seed + i,
            max_tokens=r.max_tokens,
            ignore_eos=r.ignore_eos,
        )
        for i, r in enumerate(requests)
    ]
    t = time.perf_counter()
    outs = llm.generate([r.prompt_token_ids for r in requests], params, use_tqdm=False)
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    print(
        f"{args.workload}: {len(requests)} requests, "
        f"{f'temperature {args.temperature}' if args.temperature else 'greedy'}, prompts "
        f"{statistics.fmean(len(r.prompt_token_ids) for r in requests):.0f} tokens, outputs "
        f"{statistics.fmean(lengths):.0f} (max {max(lengths)}) on average, "
        f"generated in {time.perf_counter() - t:.0f} s"
    )
    for o in outs[: args.show]:
        print(f"--- {o.request_id}: {len(o.outputs[0].token_ids)} tokens\n{o.outputs[0].text}")
    stopped = sum(o.outputs[0].finish_reason == "stop" for o in outs)
    print(f"{stopped} of {len(outs)} ended at EOS, the others at max_tokens")
    print(
        f"{'proposer':>9} {'min':>4} {'max':>4} {'k':>3} {'proposed':>9} {'accepted':>9} "
        f"{'acc/draft':>9} {'tok/step':>9} {'us/call':>8} {'EOS-only':>9}"
    )
    for cls, name in ((NgramProposer, "recent"), (EarliestNgramProposer, "earliest")):
        for lo, hi in LOOKUPS:
            for k in KS:
                total, at_eos = Replay(), Replay()
                proposer = cls(k, lo, hi)
                for r, o in zip(requests, outs, strict=True):
                    one = replay(proposer, list(r.prompt_token_ids), list(o.outputs[0].token_ids))
                    total.add(one)
                    if o.outputs[0].finish_reason == "stop":
                        at_eos.add(one)
                print(
                    f"{name:>9} {lo:4d} {hi:4d} {k:3d} {total.proposed / total.steps:9.1%} "
                    f"{total.accepted / total.steps:9.2f} "
                    f"{total.accepted / max(total.drafted, 1):9.1%} "
                    f"{total.tokens / total.steps:9.2f} {1e6 * total.seconds / total.steps:8.1f} "
                    f"{at_eos.tokens / max(at_eos.steps, 1):9.2f}"
                )
    pairs = [
        (list(r.prompt_token_ids), list(o.outputs[0].token_ids))
        for r, o in zip(requests, outs, strict=True)
    ]
    by_match_length(pairs, max(hi for _, hi in LOOKUPS))
    at_eos = [o.outputs[0].finish_reason == "stop" for o in outs]
    print_policy(
        [(p, o, s) for (p, o), s in zip(pairs, at_eos, strict=True)],
        args.temperature,
        args.draft_cost,
    )


if __name__ == "__main__":
    main()
