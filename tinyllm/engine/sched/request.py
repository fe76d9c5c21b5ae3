"""A request as the engine core sees it: token ids, how many are computed, its blocks."""

import enum

from llguidance import LLMatcher

from tinyllm.engine.outputs import TokenLogprob
from tinyllm.engine.pooling_params import PoolingParams
from tinyllm.engine.sampling_params import SamplingParams
from tinyllm.engine.sched.block_pool import BlockKey
from tinyllm.engine.spec_decode.ngram_proposer import NgramIndex


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """Prompt and generated ids in one list; `num_computed_tokens` of them have K/V in the
    cache. Admission starts it after the tokens the prefix cache holds; each step runs some of
    the rest: a chunk of the prompt, or the last sampled token. Preemption frees the blocks and
    sets `num_computed_tokens` back to 0 (recompute, from whatever the cache still holds)."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        max_tokens: int,
        eos_token_ids: list[int],
        seed: int,
        matcher: LLMatcher | None = None,
        pooling: PoolingParams | None = None,
    ):
        """`pooling`: a pooling request, which runs its prompt and finishes with the pooled
        vector instead of sampling (`params` are then unused)."""
        self.request_id, self.params, self.pooling = request_id, params, pooling
        # Structured output: where the output is in the grammar. The scheduler advances it after
        # each step; a preempted request keeps it, since the tokens it accepted stay in the
        # output.
        self.matcher = matcher
        self.prompt_token_ids = list(prompt_token_ids)
        self.all_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.max_tokens = max_tokens
        self.num_computed_tokens = 0
        self.num_ever_computed = 0  # high-water mark: what a recompute does again
        self.block_ids: list[int] = []
        # Prefix cache: its full blocks' keys (they depend on its tokens only), how many of its
        # blocks are registered, and how many prompt tokens its first admission found cached.
        self.block_keys: list[BlockKey] = []
        self.num_registered_blocks = 0
        self.num_cached_tokens: int | None = None
        # Prompt token i's logprob under tokens 0..i-1, filled as the prompt is computed (the
        # first token has none). A recompute after preemption finds them already there.
        self.prompt_logprobs: list[TokenLogprob | None] | None = (
            None if params.prompt_logprobs is None else [None]
        )
        # Speculative decoding (spec_decode/speculator.py): the draft tokens to verify in the next
        # step after the last sampled token, and the n-grams of its tokens that drafts are
        # looked up in (made at its first lookup, grown with its tokens: a preempted request
        # keeps its tokens, so it keeps them too).
        self.spec_token_ids: list[int] = []
        self.spec_ngrams: NgramIndex | None = None
        self.status = RequestStatus.WAITING
        self.num_preemptions = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self._stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self._stop_ids.update(eos_token_ids)
        # The seed of its own random generator (the runner's), so a seed gives the same tokens
        # whatever else shares the batch.
        self.seed = params.seed if params.seed is not None else seed
        # How many of its token ids and block ids the runner has been sent (step_message).
        self.num_sent_tokens = self.num_sent_blocks = 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token: int, max_model_len: int) -> None:
        """Record a sampled token; set the finish reason if it ends the request."""
        self.all_token_ids.append(token)
        if token in self._stop_ids:
            self.finish_reason, self.stop_reason = "stop", token
        elif self.matcher is not None and self.matcher.is_stopped():  # the grammar is complete
            self.finish_reason = "stop"
        elif self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len:
            self.finish_reason = "length"
