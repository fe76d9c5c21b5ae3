"""Speculative decoding by n-gram prompt lookup: which requests get draft tokens each step.

A decoding request whose recent tokens occurred earlier in its context gets the tokens that
followed them as drafts (engine/ngram_proposer.py). The scheduler runs them with the request's
next token as one row of 1 + k query tokens; the sampler keeps the drafts the model agrees with
and adds the model's own next token (engine/sampler.py `verify`); the engine rolls the rest back.
Greedy output is the same token for token as without speculation, since the K/V and logits of
each position do not depend on what shares the step (the default CPU path is batch-invariant).

Speculation pays only when the step is bound by reading the weights: a few rows cost about one.
So it is skipped when it would not pay:
- a request the drafts do not fit: structured output (its grammar would have to advance
  through each draft and roll back) and repetition/presence/frequency penalties (they depend
  on the tokens before each position);
- a request drafts at most 2 tokens more than it last accepted (each draft costs the step
  about what a decode row costs: docs/INFERENCE.md), and one whose drafts were all rejected
  waits before it drafts again, twice as long after each miss, up to `_MAX_BACKOFF` steps:
  text with nothing to find costs little;
- a sampled request (temperature > 0) drafts only from a match of at least
  `_SAMPLED_LOOKUP_MIN` tokens: its draft t is accepted with probability p(t), not whenever t
  is the argmax, and text with nothing to copy matches single tokens by chance, so a 1-token
  match costs a sampled request more than it gains (docs/INFERENCE.md);
- a step with more than `max_batch` decoding requests: the weights are already shared by
  enough rows.
"""

import dataclasses
from dataclasses import dataclass

from tinyllm.engine.config import SpeculativeConfig
from tinyllm.engine.ngram_proposer import NgramProposer
from tinyllm.engine.request import Request

_MAX_BACKOFF = 16  # steps a request without accepted drafts waits, at most
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
        if request.spec_wait > 0:
            request.spec_wait -= 1
            return []
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
        limit = min(room - 1, request.spec_limit or self.config.num_speculative_tokens)
        proposer = self.proposer if p.greedy else self.sampled_proposer
        if request.spec_ngrams is None:  # a request is greedy or not for its whole life
            request.spec_ngrams = proposer.new_index()
        return proposer.propose(request.all_token_ids, limit, request.spec_ngrams)

    def record(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """A verified row: count it, set how many drafts the request gets next, and back off
        one whose drafts all failed."""
        self.stats.num_drafts += 1
        self.stats.num_draft_tokens += num_drafts
        self.stats.num_accepted_tokens += num_accepted
        request.spec_limit = num_accepted + 2
        if num_accepted:
            request.spec_backoff = 0
        else:
            request.spec_backoff = min(2 * request.spec_backoff + 1, _MAX_BACKOFF)
            request.spec_wait = request.spec_backoff
