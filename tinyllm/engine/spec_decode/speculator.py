"""Speculative decoding by n-gram prompt lookup: which requests get draft tokens each step.

A decoding request whose recent tokens occurred earlier in its context gets the tokens that
followed them as drafts (spec_decode/ngram_proposer.py). The scheduler runs them with the request's
next token as one row of 1 + k query tokens; the sampler keeps the drafts the model agrees with
and adds the model's own next token (worker/sampler.py `verify`); the scheduler rolls the rest back.
Greedy output is the same token for token as without speculation, since the K/V and logits of
each position do not depend on what shares the step (the default CPU path is batch-invariant).

Speculation pays only when the step is bound by reading the weights: a few rows cost about one.
So it is skipped when it would not pay:
- a request the drafts do not fit: structured output (its grammar would have to advance
  through each draft and roll back) and repetition/presence/frequency penalties (they depend
  on the tokens before each position);
- a request drafts as many tokens as its match is worth: 2^(n - 1) from a match of n tokens
  (1, 2, 4, 8, ..., at most `num_speculative_tokens`), `_drafts_for_match` says why; so text
  with nothing to copy, which matches single tokens by chance, drafts one token at a time;
- a sampled request (temperature > 0) drafts only from a match of at least
  `_SAMPLED_LOOKUP_MIN` tokens: its draft t is accepted with probability p(t), not whenever t
  is the argmax, and text with nothing to copy matches single tokens by chance, so a 1-token
  match costs a sampled request more than it gains (docs/MEASUREMENTS.md, "When a draft pays");
- a step with more than `max_batch` decoding requests: the weights are already shared by
  enough rows.
"""

import dataclasses
from dataclasses import dataclass

from tinyllm.engine.config import SpeculativeConfig
from tinyllm.engine.sched.request import Request
from tinyllm.engine.spec_decode.ngram_proposer import NgramProposer

_SAMPLED_LOOKUP_MIN = 2  # the shortest match a sampled request drafts from


@dataclass
class SpecStats:
    """vLLM's spec-decode counters: draft runs, tokens drafted, tokens accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def __add__(self, other: "SpecStats") -> "SpecStats":
        pairs = zip(dataclasses.astuple(self), dataclasses.astuple(other), strict=True)
        return SpecStats(*(a + b for a, b in pairs))

    def __sub__(self, other: "SpecStats") -> "SpecStats":
        pairs = zip(dataclasses.astuple(self), dataclasses.astuple(other), strict=True)
        return SpecStats(*(a - b for a, b in pairs))

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verified row yields on average: its accepted drafts plus the model's own."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        self.config, self.max_model_len = config, max_model_len
        lo, hi = config.prompt_lookup_min, config.prompt_lookup_max
        self.proposer = NgramProposer(config.num_speculative_tokens, lo, hi)
        # Never beyond prompt_lookup_max: a user who asked for 1-token matches only gets them.
        sampled_lo = min(max(lo, _SAMPLED_LOOKUP_MIN), hi)
        self.sampled_proposer = NgramProposer(config.num_speculative_tokens, sampled_lo, hi)
        self.stats = SpecStats()

    def propose(self, running: list[Request]) -> None:
        """Set each running request's `spec_token_ids` for the coming step."""
        decoding = [r for r in running if r.num_tokens - r.num_computed_tokens == 1]
        crowded = len(decoding) > self.config.max_batch
        for request in decoding:
            request.spec_token_ids = [] if crowded else self._drafts(request)

    def _drafts(self, request: Request) -> list[int]:
        p = request.params
        if request.matcher is not None or p.repetition_penalty != 1.0:
            return []
        if p.presence_penalty or p.frequency_penalty:
            return []
        # The model's own token follows the drafts: room for both, in the output and the context.
        room = min(
            request.max_tokens - request.num_output_tokens, self.max_model_len - request.num_tokens
        )
        if room < 2:
            return []
        proposer = self.proposer if p.greedy else self.sampled_proposer
        if request.spec_ngrams is None:  # a request is greedy or not for its whole life
            request.spec_ngrams = proposer.new_index()
        match = proposer.match(request.all_token_ids, request.spec_ngrams)
        if match is None:
            return []
        limit = min(room - 1, self.config.num_speculative_tokens, _drafts_for_match(match.length))
        return match.drafts(request.all_token_ids, limit)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        """A verified row: count its drafts and the accepted ones."""
        self.stats.num_drafts += 1
        self.stats.num_draft_tokens += num_drafts
        self.stats.num_accepted_tokens += num_accepted


def _drafts_for_match(length: int) -> int:
    """How many tokens a match of `length` tokens is worth drafting: 2^(length - 1).

    The longer the match, the likelier its drafts are right (benchmarks/ngram_acceptance.py
    measures how likely), and each draft adds a small fraction of a plain decode step to the
    step (benchmarks/spec_verify_cost.py), so the i-th draft pays while the chance that it and
    those before it are accepted, about p^i, beats that fraction: the drafts that pay grow about
    twofold per token of match. The match predicts a draft better than the request's last
    verified row does (docs/MEASUREMENTS.md, "Draft length from the match")."""
    return 2 ** (length - 1)
