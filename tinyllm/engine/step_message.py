"""The step's two messages, data only: what the scheduler sends the model runner, and what the
runner sends back. Nothing in them refers to the scheduler's live objects, so a runner in
another process (a tensor-parallel rank) runs a step from the message alone.

The runner keeps its own state per request (token ids, blocks, sampling settings, random
generator) from these messages, and drops it when the request's id comes back as finished. A
request's entry says where its new token ids and block ids go (an offset into what the runner
holds) rather than only appending them, so applying the same entry twice leaves the same state:
the executor re-runs a failed step's requests one at a time with the entries already sent.
"""

from dataclasses import dataclass, field

import torch

from tinyllm.engine.outputs import TokenLogprob
from tinyllm.engine.pooling_params import PoolingParams
from tinyllm.engine.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen: everything it keeps about it."""

    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # its random generator's seed: one generator per request, the runner's
    block_ids: list[int]
    pooling: PoolingParams | None = None  # a pooling request: pooled, not sampled


@dataclass
class CachedRequestData:
    """A request the runner holds: the token ids and block ids it lacks, from where they go."""

    req_id: str
    token_offset: int
    new_token_ids: list[int]  # the tokens sampled since it last ran, usually one
    block_offset: int  # 0 after a preemption: every block is new
    new_block_ids: list[int]


@dataclass
class SchedulerOutput:
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    # Tokens each request runs this step, in the scheduler's order: from num_computed_tokens
    # on, its draft tokens (speculative decoding) last.
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    num_computed_tokens: dict[str, int] = field(default_factory=dict)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Structured output: the requests sampled under a grammar and, row by row, the tokens each
    # may take (llguidance's bitmask, 32 tokens per int32), computed on the scheduler's side.
    grammar_req_ids: list[str] = field(default_factory=list)
    grammar_bitmask: torch.Tensor | None = None
    # Ended since the last step (finished, aborted, refused): the runner forgets them.
    finished_req_ids: list[str] = field(default_factory=list)
    # For the scheduler's side only: preempted this step, and refused (can never fit the pool).
    preempted_req_ids: list[str] = field(default_factory=list)
    rejected_req_ids: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    def only(self, req_id: str) -> "SchedulerOutput":
        """This step's message for one of its requests alone."""

        def own(entries: list) -> list:
            return [e for e in entries if e.req_id == req_id]

        rows = [i for i, r in enumerate(self.grammar_req_ids) if r == req_id]
        return SchedulerOutput(
            new_requests=own(self.new_requests),
            cached_requests=own(self.cached_requests),
            num_scheduled_tokens={req_id: self.num_scheduled_tokens[req_id]},
            num_computed_tokens={req_id: self.num_computed_tokens[req_id]},
            spec_token_ids={k: v for k, v in self.spec_token_ids.items() if k == req_id},
            grammar_req_ids=[req_id] * len(rows),
            grammar_bitmask=self.grammar_bitmask[rows] if rows else None,
        )


@dataclass
class ModelRunnerOutput:
    # The requests that sampled (their tokens are all computed after the step), and for each
    # the draft tokens the model accepted, then one token of its own, with their logprobs.
    req_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[TokenLogprob | None]] = field(default_factory=list)
    # Prompt logprobs computed this step, in position order after those sent before.
    prompt_logprobs: dict[str, list[TokenLogprob | None]] = field(default_factory=dict)
    # The pooling requests whose prompt is done: each one's embedding or scores.
    pooled: dict[str, torch.Tensor] = field(default_factory=dict)
