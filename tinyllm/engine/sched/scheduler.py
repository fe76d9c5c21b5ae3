"""Who runs next, and how many tokens each: one token budget for decodes and prefill chunks.

Each step: running requests first, oldest first, each its next token (a decode, followed by
its draft tokens when speculative decoding proposed some: spec_decode/speculator.py) or the next
chunk of a prompt still being prefilled; then waiting requests, oldest first, while the budget,
`max_num_seqs` and free blocks allow, the last one's prompt chunked to fit what is left. A
waiting request first matches the prefix cache: it shares the matched blocks and starts after
them. Every block is allocated here, before the forward pass. When a running request cannot
get a block, the newest running request is preempted: its blocks are freed,
`num_computed_tokens` goes back to 0 and it waits at the front of the queue to be recomputed
(recompute, not swap), matching the cache again when it is readmitted (its own full
blocks may still be there).

The step leaves as a message of data (engine/step_message.py): what the runner lacks of each
scheduled request, and the ids of the requests ended since the last step. What the runner sends
back is booked here too (`update_from_output`): computed tokens, drafts rolled back, prompt
logprobs, grammars advanced, tokens appended, finishes (a stop token, a complete grammar, the
length limit).
"""

from collections import deque
from collections.abc import Iterable

from tinyllm.engine.output_processor import TokenUpdate
from tinyllm.engine.sched.kv_cache_manager import KVCacheManager
from tinyllm.engine.sched.request import Request, RequestStatus
from tinyllm.engine.spec_decode.speculator import Speculator
from tinyllm.engine.step_message import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from tinyllm.engine.structured_output.manager import StructuredOutputManager


def step_message(
    scheduled: list[tuple[Request, int]], finished_req_ids: list[str] | None = None
) -> SchedulerOutput:
    """The message for running each request's next `n` tokens (its `spec_token_ids` last):
    a request the runner has not seen whole, the others by the tokens and blocks it lacks."""
    out = SchedulerOutput(finished_req_ids=finished_req_ids or [])
    for request, n in scheduled:
        rid = request.request_id
        if request.num_sent_tokens == 0:
            new = NewRequestData(
                rid,
                request.prompt_token_ids,
                request.params,
                request.seed,
                list(request.block_ids),
                request.pooling,
            )
            out.new_requests.append(new)
        else:
            tokens, blocks = request.num_sent_tokens, request.num_sent_blocks
            cached = CachedRequestData(
                rid, tokens, request.all_token_ids[tokens:], blocks, request.block_ids[blocks:]
            )
            out.cached_requests.append(cached)
        request.num_sent_tokens = request.num_tokens
        request.num_sent_blocks = len(request.block_ids)
        out.num_scheduled_tokens[rid] = n
        out.num_computed_tokens[rid] = request.num_computed_tokens
        if request.spec_token_ids:
            out.spec_token_ids[rid] = list(request.spec_token_ids)
    return out


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        *,
        max_model_len: int = 2**63,
        structured_output: StructuredOutputManager | None = None,
        speculator: Speculator | None = None,
        whole_prompts: bool = False,
    ):
        """The keyword arguments are for `update_from_output`: the context a request finishes
        at (by default none: only its max_tokens), who advances grammars, who counts drafts;
        and `whole_prompts`: a non-causal model's, whose prompts run whole in one step (the
        engine refuses one over the budget)."""
        self.kv = kv
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.max_model_len = max_model_len
        self.structured_output, self.speculator = structured_output, speculator
        self.whole_prompts = whole_prompts
        self.requests: dict[str, Request] = {}  # every request not finished, by its id
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the newest is last
        self.num_preemptions = 0
        self.prompt_tokens = 0  # prompt tokens computed, recomputes not counted again
        self.generation_tokens = 0  # tokens sampled and kept
        self.recomputed_tokens = 0  # prefill work redone for preempted requests
        self._finished_req_ids: list[str] = []  # ended since the last step, for the runner

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        scheduled: list[tuple[Request, int]] = []
        preempted: list[Request] = []
        rejected: list[Request] = []
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            # Its draft tokens (speculative decoding) run after its next token, as far as the
            # budget goes; without blocks for them it runs without them before anyone is
            # preempted.
            base = request.num_tokens - request.num_computed_tokens
            n = min(base + len(request.spec_token_ids), budget)
            del request.spec_token_ids[max(n - base, 0) :]
            while not self.kv.allocate(request, n):
                if request.spec_token_ids:
                    n -= len(request.spec_token_ids)
                    request.spec_token_ids = []
                    continue
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if request.status is RequestStatus.WAITING:
                break  # it was the newest: nothing after it is left to schedule
            scheduled.append((request, n))
            budget -= n
            i += 1
        # After a preemption there is no room to spare: admitting now would only preempt again.
        while self.waiting and budget > 0 and not preempted:
            if len(self.running) >= self.max_num_seqs:
                break
            request = self.waiting[0]
            if not self.kv.fits_ever(request.num_tokens + 1):
                rejected.append(self.waiting.popleft())
                continue
            # It starts after what the prefix cache holds (nothing when caching is off).
            matched = self.kv.match(request)
            start = len(matched) * self.kv.block_size
            n = min(request.num_tokens - start, budget)
            if self.whole_prompts and n < request.num_tokens - start:
                break  # it runs whole in a later step
            # Room for the chunk and one token more (the first decode token once the prompt
            # is done), so an admitted request is not preempted by its own next step.
            if not self.kv.can_admit(request, matched, start + n + 1):
                break
            self.kv.admit(request, matched)
            self.kv.allocate(request, n)
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append((request, n))
            budget -= n
        out = step_message(scheduled, self._finished_req_ids)
        self._finished_req_ids = []
        out.preempted_req_ids = [r.request_id for r in preempted]
        out.rejected_req_ids = [r.request_id for r in rejected]
        return out

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.spec_token_ids = []
        request.num_computed_tokens = request.num_sent_blocks = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        # Victims come newest first, so each one in front leaves the oldest at the head.
        self.waiting.appendleft(request)

    def finish(self, request: Request, reason: str | None = None) -> None:
        """Take a request out (finished, aborted or refused) and give back its blocks."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING and request in self.waiting:
            self.waiting.remove(request)
        if request.block_ids:
            self.kv.free(request)
        if request.num_sent_tokens:  # the runner holds its state
            self._finished_req_ids.append(request.request_id)
        request.status = RequestStatus.FINISHED
        if reason is not None:
            request.finish_reason = reason
        self.requests.pop(request.request_id, None)
        request.matcher = None  # its grammar state can be large; the request may be kept

    def finish_requests(self, request_ids: Iterable[str], reason: str) -> None:
        """Finish the requests among these that are not finished yet, for a reason from
        outside a step's tokens: aborted, refused, failed, ended by a stop string."""
        for request in [self.requests[r] for r in request_ids if r in self.requests]:
            self.finish(request, reason)

    # -- after the step ----------------------------------------------------------------------

    def update_from_output(
        self, out: SchedulerOutput, result: ModelRunnerOutput
    ) -> list[TokenUpdate]:
        """Book what a step did: computed tokens (rejected drafts rolled back), prompt logprobs,
        grammars advanced, sampled tokens appended; finish the requests that a stop token, a
        complete grammar or the length limit ended. Returns each sampled request's update for
        the output processor."""
        sampled = [
            (self.requests[req_id], tokens, logprobs)
            for req_id, tokens, logprobs in zip(
                result.req_ids, result.sampled_token_ids, result.logprobs, strict=True
            )
        ]
        # Draft tokens the model rejected are rolled back: their K/V stays in the blocks, to
        # be overwritten by the tokens that really come there.
        rejected = {req: len(req.spec_token_ids) + 1 - len(tokens) for req, tokens, _ in sampled}
        for req_id, n in out.num_scheduled_tokens.items():
            request = self.requests[req_id]
            n -= rejected.get(request, 0)
            self._count(request, n)
            request.num_computed_tokens += n
            if req_id in result.prompt_logprobs:
                request.prompt_logprobs += result.prompt_logprobs[req_id]
        if self.structured_output is not None:
            self.structured_output.advance(out, result, self.requests)
        updates = []
        for req_id, pooled in result.pooled.items():  # a pooling request ends with its prompt
            request = self.requests[req_id]
            updates.append(
                TokenUpdate(
                    req_id,
                    [],
                    [],
                    "stop",
                    num_cached_tokens=request.num_cached_tokens,
                    pooled=pooled,
                )
            )
            self.finish(request, "stop")
        for request, tokens, logprobs in sampled:
            kept = self._append(request, tokens)
            updates.append(
                TokenUpdate(
                    request.request_id,
                    tokens[:kept],
                    logprobs[:kept],
                    request.finish_reason,
                    request.stop_reason,
                    num_cached_tokens=request.num_cached_tokens,
                    # Complete once the prompt is: with its first sampled token.
                    prompt_logprobs=request.prompt_logprobs
                    if request.num_output_tokens == kept
                    else None,
                )
            )
            self.generation_tokens += kept
            if request.finish_reason is not None:
                self.finish(request)
        return updates

    def _append(self, request: Request, tokens: list[int]) -> int:
        """Append a request's sampled tokens (its accepted drafts, then the model's own), its
        drafts counted; how many it kept."""
        if request.spec_token_ids:  # only the speculator sets them
            self.speculator.record(len(request.spec_token_ids), len(tokens) - 1)
            request.spec_token_ids = []
        # A stop token or the length limit inside an accepted run ends it there.
        kept = 0
        while kept < len(tokens) and request.finish_reason is None:
            request.append_token(tokens[kept], self.max_model_len)
            kept += 1
        return kept

    def _count(self, request: Request, n: int) -> None:
        """Count the prompt tokens that `n` more computed tokens compute, and those they
        compute again after a preemption."""
        start, end = request.num_computed_tokens, request.num_computed_tokens + n
        redone = max(0, min(end, request.num_ever_computed) - start)
        self.recomputed_tokens += redone
        self.prompt_tokens += max(0, min(end, request.num_prompt_tokens) - start - redone)
        request.num_ever_computed = max(request.num_ever_computed, end)
