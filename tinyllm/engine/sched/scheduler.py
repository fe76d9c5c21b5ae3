"""Who runs next, and how many tokens each: one token budget for decodes and prefill chunks.

Each step: running requests first, oldest first, each its next token (a decode, followed by
its draft tokens when speculative decoding proposed some: spec_decode/speculator.py) or the next
chunk of a prompt still being prefilled; then waiting requests, oldest first, while the budget,
`max_num_seqs` and free blocks allow, the last one's prompt chunked to fit what is left. A
waiting request first matches the prefix cache: it shares the matched blocks and starts after
them. Every block is allocated here, before the forward pass. When a running request cannot
get a block, the newest running request is preempted: its blocks are freed,
`num_computed_tokens` goes back to 0 and it waits at the front of the queue to be recomputed
(the founding design's policy), matching the cache again when it is readmitted (its own full
blocks may still be there).

The step leaves as a message of data (engine/step_message.py): what the runner lacks of each
scheduled request, and the ids of the requests ended since the last step.
"""

from collections import deque

from tinyllm.engine.sched.kv_cache_manager import KVCacheManager
from tinyllm.engine.sched.request import Request, RequestStatus
from tinyllm.engine.step_message import CachedRequestData, NewRequestData, SchedulerOutput


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
                rid, request.prompt_token_ids, request.params, request.seed, list(request.block_ids)
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
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.kv = kv
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the newest is last
        self.num_preemptions = 0
        self._finished_req_ids: list[str] = []  # ended since the last step, for the runner

    def add(self, request: Request) -> None:
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
