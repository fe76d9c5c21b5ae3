"""Driving an LLMEngine through a workload step by step, recording what each step looked like."""

import time
from dataclasses import dataclass, field

from tqdm import tqdm

from tinyllm import SamplingParams
from tinyllm.engine.engine import EngineStats, LLMEngine
from tinyllm.entrypoints.workloads import Request


@dataclass
class StepSample:
    stats: EngineStats
    used_tokens: int  # tokens stored in the KV cache
    allocated_tokens: int  # tokens handed to sequences (stored or held for them)
    reserved_tokens: int  # the cache's whole capacity


@dataclass
class Trace:
    seconds: float
    outputs: dict[str, list[int]]  # request id -> generated token ids
    steps: list[StepSample] = field(default_factory=list)

    @property
    def final(self) -> EngineStats:
        return self.steps[-1].stats


def drive(engine: LLMEngine, requests: list[Request], desc: str) -> Trace:
    """Run every request greedily to its max_tokens (EOS ignored), sampling after each step."""
    for i, r in enumerate(requests):
        params = SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True)
        engine.add_request(None, params, request_id=str(i), prompt_token_ids=r.prompt_token_ids)
    trace = Trace(0.0, {})
    bar = tqdm(total=len(requests), desc=desc, unit="req")
    start = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                trace.outputs[out.request_id] = out.token_ids
                bar.update(1)
        kv = engine.kv
        used = sum(r.num_computed_tokens for r in engine.scheduler.running)
        allocated = kv.pool.num_used * kv.block_size
        sample = StepSample(engine.stats(), used, allocated, kv.capacity_tokens)
        trace.steps.append(sample)
    trace.seconds = time.perf_counter() - start
    bar.close()
    return trace
