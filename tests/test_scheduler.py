"""The scheduler on its own: CPU bookkeeping, no model. `step()` below does by hand what
Scheduler.update_from_output does after the forward pass: advance `num_computed_tokens` by what
ran, give a request whose tokens are all computed one sampled token, and finish it when that
ends it."""

import math
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tinyllm.engine.sampling_params import SamplingParams
from tinyllm.engine.sched.kv_cache_manager import KVCacheManager
from tinyllm.engine.sched.request import Request, RequestStatus
from tinyllm.engine.sched.scheduler import Scheduler
from tinyllm.engine.step_message import SchedulerOutput

MAX_MODEL_LEN = 256
TOKEN = 3  # what the "model" samples: never a stop token (no eos, no stop_token_ids)


def make_request(request_id: str, prompt_len: int, max_tokens: int = 100) -> Request:
    return Request(
        request_id,
        [(7 * j) % 50 for j in range(prompt_len)],
        SamplingParams(max_tokens=max_tokens),
        max_tokens,
        eos_token_ids=[],
        seed=0,
    )


def make_scheduler(
    num_blocks: int, block_size: int, budget: int, max_num_seqs: int = 8
) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, block_size), max_num_seqs, budget)


@dataclass
class Step:
    """A step's SchedulerOutput with its request ids as the test's requests."""

    message: SchedulerOutput
    scheduled: list[tuple[Request, int]]
    preempted: list[Request]
    rejected: list[Request]

    @property
    def num_tokens(self) -> int:
        return self.message.num_tokens


def schedule(sched: Scheduler) -> Step:
    known = {r.request_id: r for r in [*sched.running, *sched.waiting]}
    out = sched.schedule()
    return Step(
        out,
        [(known[req_id], n) for req_id, n in out.num_scheduled_tokens.items()],
        [known[req_id] for req_id in out.preempted_req_ids],
        [known[req_id] for req_id in out.rejected_req_ids],
    )


def step(sched: Scheduler, max_model_len: int = MAX_MODEL_LEN) -> tuple[Step, list]:
    """One engine step without the model; returns the output and the requests that sampled."""
    out = schedule(sched)
    return out, run(sched, out, max_model_len)


def run(sched: Scheduler, out: Step, max_model_len: int) -> list[Request]:
    """What the engine does with a SchedulerOutput once the model has run."""
    for request in out.rejected:  # the engine reports an error and releases it
        sched.finish(request, "error")
    sampled = []
    for request, n in out.scheduled:
        request.num_computed_tokens += n
        if request.num_computed_tokens == request.num_tokens:
            request.append_token(TOKEN, max_model_len)
            sampled.append(request)
            if request.finish_reason is not None:
                sched.finish(request)
    return sampled


def ids(requests) -> list[str]:
    return [r.request_id for r in requests]


def scheduled(out: Step) -> list[tuple[str, int]]:
    return [(r.request_id, n) for r, n in out.scheduled]


# -- the token budget -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("budget", "chunks"),
    [
        (32, [32, 32, 32, 4]),  # chunks end on block boundaries (32 = 2 blocks)
        (24, [24, 24, 24, 24, 4]),  # 24 and 72 end inside a block, 48 and 96 on a boundary
        (16, [16, 16, 16, 16, 16, 16, 4]),
    ],
)
def test_long_prompt_is_prefilled_in_budget_sized_chunks(budget, chunks):
    sched = make_scheduler(num_blocks=64, block_size=16, budget=budget)
    r = make_request("r", 100)
    sched.add(r)
    for k, chunk in enumerate(chunks):
        out, sampled = step(sched)
        assert scheduled(out) == [("r", chunk)]
        assert r.num_computed_tokens == sum(chunks[: k + 1])
        # blocks for exactly the tokens computed so far: none reserved ahead
        assert len(r.block_ids) == math.ceil(r.num_computed_tokens / 16)
        if k < len(chunks) - 1:
            assert sampled == [] and r.num_output_tokens == 0  # mid-prompt: nothing sampled
        else:
            assert sampled == [r] and r.num_output_tokens == 1
    assert len(r.block_ids) == 7
    out, sampled = step(sched)  # then a decode: one token
    assert scheduled(out) == [("r", 1)] and sampled == [r] and r.num_output_tokens == 2
    assert len(r.block_ids) == 7  # token 101 still fits in the 7th block


def test_running_requests_are_served_before_waiting_ones():
    sched = make_scheduler(num_blocks=64, block_size=16, budget=32)
    a = make_request("a", 4)
    sched.add(a)
    step(sched)  # a's prompt, then it decodes
    b = make_request("b", 100)
    sched.add(b)
    out, _ = step(sched)
    assert scheduled(out) == [("a", 1), ("b", 31)]  # 1 decode + (budget - 1) of b's prompt
    assert out.num_tokens == 32
    c = make_request("c", 8)
    sched.add(c)
    out, _ = step(sched)
    # b, mid-prompt, is running: it gets the budget's rest before c is looked at
    assert scheduled(out) == [("a", 1), ("b", 31)]
    assert ids(sched.waiting) == ["c"]


def test_max_num_seqs_caps_running_requests():
    sched = make_scheduler(num_blocks=64, block_size=4, budget=64, max_num_seqs=2)
    a, b, c = (make_request(x, 3, max_tokens=2) for x in "abc")
    for r in (a, b, c):
        sched.add(r)
    out, _ = step(sched)
    assert scheduled(out) == [("a", 3), ("b", 3)]  # budget and blocks would allow c too
    assert ids(sched.waiting) == ["c"] and len(sched.running) == 2
    out, _ = step(sched)  # a and b decode their second (last) token and finish
    assert scheduled(out) == [("a", 1), ("b", 1)]
    assert a.finished and b.finished and ids(sched.waiting) == ["c"]
    out, _ = step(sched)
    assert scheduled(out) == [("c", 3)]


# -- the reserve: room for an admitted prompt's first decode token --------------------------


def _one_running_holding_two_of_four_blocks() -> tuple[Scheduler, Request]:
    sched = make_scheduler(num_blocks=4, block_size=4, budget=64)
    a = make_request("a", 7)
    sched.add(a)
    step(sched)  # a: 7 tokens computed in 2 blocks, its 8th (sampled) fits in them
    assert len(a.block_ids) == 2 and a.num_tokens == 8
    return sched, a


def test_prompt_of_k_blocks_is_not_admitted_with_exactly_k_free_blocks():
    """A prompt of exactly k * block_size tokens needs k + 1 blocks: its first decode token
    starts a new block. Admitted into k blocks, it would be preempted by its own next step."""
    sched, a = _one_running_holding_two_of_four_blocks()
    b = make_request("b", 8)  # 2 blocks' worth, 2 blocks free
    sched.add(b)
    out, _ = step(sched)
    assert scheduled(out) == [("a", 1)]
    assert out.preempted == [] and out.rejected == []
    assert ids(sched.waiting) == ["b"] and b.block_ids == []
    assert sched.kv.pool.num_free == 2


def test_prompt_one_short_of_k_blocks_is_admitted_with_k_free_blocks():
    sched, a = _one_running_holding_two_of_four_blocks()
    a.max_tokens = 2  # a ends this step, so only b's own growth matters after it
    b = make_request("b", 7)  # 7 + 1 tokens: 2 blocks
    sched.add(b)
    out, _ = step(sched)
    assert scheduled(out) == [("a", 1), ("b", 7)]
    assert b.status is RequestStatus.RUNNING and len(b.block_ids) == 2
    assert a.finished and sched.kv.pool.num_free == 2
    out, _ = step(sched)  # b's first decode token fits in the blocks it was admitted with
    assert scheduled(out) == [("b", 1)] and out.preempted == []
    assert len(b.block_ids) == 2


def test_a_prefill_chunk_is_admitted_only_with_room_for_one_token_more():
    """The same reserve when the prompt is chunked: chunk + 1 tokens must fit."""
    sched = make_scheduler(num_blocks=4, block_size=4, budget=9)
    a = make_request("a", 7)
    sched.add(a)
    step(sched)  # a holds 2 blocks
    b = make_request("b", 12)
    sched.add(b)
    out, _ = step(sched)  # budget left after a's decode: 8 = 2 blocks, 2 free; 9 needs 3
    assert scheduled(out) == [("a", 1)]
    assert ids(sched.waiting) == ["b"]


# -- preemption -----------------------------------------------------------------------------


def test_the_newest_running_request_is_preempted_mid_decode_and_requeued_at_the_front():
    """a, b, c, d each hold one of 4 blocks; a and b then each need a second. a preempts d (the
    newest), b preempts c: two victims in one step, back at the front of the queue ahead of w
    (which was already waiting), the older victim (c) first."""
    sched = make_scheduler(num_blocks=4, block_size=4, budget=64)
    a, b = make_request("a", 3, max_tokens=6), make_request("b", 3, max_tokens=6)
    c, d = make_request("c", 1, max_tokens=6), make_request("d", 1, max_tokens=6)
    w = make_request("w", 1, max_tokens=6)
    for r in (a, b, c, d, w):
        sched.add(r)
    out, _ = step(sched)
    assert scheduled(out) == [("a", 3), ("b", 3), ("c", 1), ("d", 1)]
    assert ids(sched.waiting) == ["w"] and sched.kv.pool.num_free == 0
    out, _ = step(sched)  # a, b: token 4 still fits their block
    assert out.preempted == [] and ids(sched.waiting) == ["w"]
    c_tokens = list(c.all_token_ids)
    assert c.num_output_tokens == 2

    out, _ = step(sched)  # a, b: token 5 needs a second block each
    assert ids(out.preempted) == ["d", "c"]  # newest first
    assert scheduled(out) == [("a", 1), ("b", 1)]
    assert ids(sched.running) == ["a", "b"]  # an older request is never the victim
    assert ids(sched.waiting) == ["c", "d", "w"]
    for victim in (c, d):
        assert victim.status is RequestStatus.WAITING
        assert victim.block_ids == [] and victim.num_computed_tokens == 0
        assert victim.num_preemptions == 1
    assert c.all_token_ids == c_tokens  # its generated tokens are kept, to be recomputed
    assert sched.num_preemptions == 2
    assert len(a.block_ids) == len(b.block_ids) == 2 and sched.kv.pool.num_free == 0

    admitted = []  # run to the end: the victims are readmitted before w, c before d
    for _ in range(300):
        out, _ = step(sched)
        admitted += [r.request_id for r, _ in out.scheduled if r.request_id not in admitted]
        if not sched.has_unfinished():
            break
    assert admitted.index("c") < admitted.index("d") < admitted.index("w")
    assert all(r.finished and r.num_output_tokens == 6 for r in (a, b, c, d, w))
    assert sched.kv.pool.num_used == 0


def test_a_recomputed_request_prefills_prompt_and_outputs_then_samples_the_next_token():
    sched = make_scheduler(num_blocks=4, block_size=4, budget=64)
    a, b, c, d = (make_request(x, n) for x, n in zip("abcd", (3, 3, 1, 1), strict=True))
    for r in (a, b, c, d):
        sched.add(r)
    for _ in range(3):
        step(sched)
    assert d.num_preemptions == 1 and d.num_tokens == 3  # 1 prompt + 2 generated
    a.max_tokens = b.max_tokens = c.max_tokens = a.num_output_tokens + 1  # they end next step
    out, _ = step(sched)
    assert a.finished and b.finished and c.status is RequestStatus.WAITING
    out, sampled = step(sched)
    assert ("c", 3) in scheduled(out) and ("d", 3) in scheduled(out)  # prompt + outputs
    assert d in sampled and d.num_output_tokens == 3  # no token sampled twice


def test_a_request_needing_a_block_while_newest_preempts_itself():
    """b is the newest: short of a block, it is its own victim; a still runs, and the blocks b
    freed are not handed to a waiting request (b, at the front) in the same step."""
    sched = make_scheduler(num_blocks=5, block_size=2, budget=4)
    a, b = make_request("a", 3), make_request("b", 3)
    sched.add(a)
    sched.add(b)
    out, _ = step(sched)
    assert scheduled(out) == [("a", 3), ("b", 1)]  # b admitted with the budget's last token
    out, _ = step(sched)
    assert scheduled(out) == [("a", 1), ("b", 2)]
    out, _ = step(sched)
    assert scheduled(out) == [("a", 1), ("b", 1)] and sched.kv.pool.num_free == 0
    out, _ = step(sched)  # b's 5th token needs a 3rd block, none is free
    assert out.preempted == [b]
    assert scheduled(out) == [("a", 1)]
    assert ids(sched.running) == ["a"] and ids(sched.waiting) == ["b"]
    assert b.block_ids == [] and b.num_computed_tokens == 0 and b.num_preemptions == 1
    # b's 2 blocks are free and 3 tokens of budget are left: enough for a chunk of b and one
    # token more, but a step that preempted admits nothing
    assert sched.kv.pool.num_free == 2
    assert sched.kv.can_hold(b, min(b.num_tokens, 3) + 1)


def test_preemption_mid_prefill():
    """b, still being prefilled in chunks, is the newest when a needs a block."""
    sched = make_scheduler(num_blocks=3, block_size=4, budget=6)
    a, b = make_request("a", 3), make_request("b", 10, max_tokens=2)
    sched.add(a)
    sched.add(b)
    out, _ = step(sched)
    assert scheduled(out) == [("a", 3), ("b", 3)]
    out, _ = step(sched)
    assert scheduled(out) == [("a", 1), ("b", 5)]
    assert b.num_computed_tokens == 8 and b.num_output_tokens == 0
    assert sched.kv.pool.num_free == 0
    out, sampled = step(sched)  # a's 5th token needs a block: b goes, mid-prompt
    assert out.preempted == [b] and scheduled(out) == [("a", 1)]
    assert b.status is RequestStatus.WAITING and ids(sched.waiting) == ["b"]
    assert b.block_ids == [] and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert b.num_tokens == 10 and b.num_output_tokens == 0  # nothing was sampled for it
    assert len(a.block_ids) == 2 and sched.kv.pool.num_free == 1
    a.max_tokens = a.num_output_tokens  # a is done: let b start over
    sched.finish(a)
    chunks = []
    for _ in range(10):
        out, _ = step(sched)
        chunks += [n for r, n in out.scheduled if r is b]
        if b.finished:
            break
    assert b.finished and chunks == [6, 4, 1]  # recomputed from token 0, then its two tokens
    assert b.num_output_tokens == 2 and sched.kv.pool.num_used == 0


# -- requests that can never fit ------------------------------------------------------------


def test_a_prompt_larger_than_the_pool_is_rejected_and_the_next_one_admitted():
    sched = make_scheduler(num_blocks=2, block_size=4, budget=64)
    big, small = make_request("big", 8), make_request("small", 2)  # 8 + 1 > 8 tokens
    sched.add(big)
    sched.add(small)
    out, _ = step(sched)
    assert out.rejected == [big] and big.finished and big.finish_reason == "error"
    assert scheduled(out) == [("small", 2)]
    assert big.block_ids == [] and ids(sched.waiting) == []


def test_a_request_that_alone_outgrows_the_pool_is_rejected_not_retried_forever():
    sched = make_scheduler(num_blocks=2, block_size=4, budget=64)
    r = make_request("r", 5, max_tokens=100)
    sched.add(r)
    history = []
    for _ in range(50):
        out, _ = step(sched)
        history.append((scheduled(out), ids(out.preempted), ids(out.rejected)))
        if not sched.has_unfinished():
            break
    assert history == [
        ([("r", 5)], [], []),
        ([("r", 1)], [], []),
        ([("r", 1)], [], []),
        ([("r", 1)], [], []),  # 8 tokens computed: the pool is full
        ([], ["r"], []),  # its 9th token needs a 3rd block: it preempts itself
        ([], [], ["r"]),  # 9 + 1 tokens can never fit
    ]
    assert r.finished and r.finish_reason == "error" and r.num_tokens == 9
    assert sched.kv.pool.num_used == 0 and sched.kv.pool.ref_cnt == [0, 0]


# -- the slot cache -------------------------------------------------------------------------


def test_slot_configuration_holds_one_block_per_request_and_never_preempts():
    max_model_len = 16
    sched = make_scheduler(num_blocks=2, block_size=max_model_len, budget=64, max_num_seqs=2)
    rs = [make_request(str(i), 5, max_tokens=100) for i in range(3)]
    for r in rs:
        sched.add(r)
    for _ in range(100):
        out, _ = step(sched, max_model_len)
        assert out.preempted == [] and out.rejected == []
        for r in sched.running:
            assert len(r.block_ids) == 1
        if not sched.has_unfinished():
            break
    for r in rs:
        assert r.finished and r.finish_reason == "length" and r.num_tokens == max_model_len
    assert sched.kv.pool.peak_used == 2 and sched.kv.pool.num_used == 0


# -- property test --------------------------------------------------------------------------

PROP_MAX_MODEL_LEN = 48

arrival = st.tuples(
    st.integers(1, 40),  # prompt length
    st.integers(1, 20),  # max_tokens
    st.integers(0, 10),  # arrival step
    st.one_of(st.none(), st.integers(0, 60)),  # abort at this step (None: never)
)


def _check_step(sched: Scheduler, out: Step, before_running, before_waiting, budget):
    kv = sched.kv
    assert out.num_tokens <= budget
    assert len(sched.running) <= sched.max_num_seqs
    reqs = [r for r, _ in out.scheduled]
    assert len(reqs) == len(set(map(id, reqs)))
    for r, n in out.scheduled:
        assert n >= 1 and r.status is RequestStatus.RUNNING
        assert r.num_computed_tokens + n <= r.num_tokens
        # blocks for exactly what it will have computed: none missing, none reserved ahead
        assert len(r.block_ids) == kv.blocks_for(r.num_computed_tokens + n)
    # the newest are preempted, newest first, and requeued at the front, oldest first
    k = len(out.preempted)
    assert out.preempted == before_running[::-1][:k]
    kept = before_running[: len(before_running) - k]
    assert sched.running[: len(kept)] == kept
    admitted = sched.running[len(kept) :]
    if k:
        assert not admitted and not out.rejected  # a step that preempted admits nothing
        assert list(sched.waiting) == out.preempted[::-1] + before_waiting
    else:
        taken = len(admitted) + len(out.rejected)
        assert list(sched.waiting) == before_waiting[taken:]
    assert [r for r, _ in out.scheduled] == [r for r in kept if r in reqs] + admitted
    if kept:  # the oldest always runs
        assert out.scheduled[0][0] is kept[0]
    if admitted:  # running requests are served before any waiting one
        assert all(r in reqs for r in kept)
    if before_running or before_waiting:  # never a step that does nothing
        assert out.scheduled or out.preempted or out.rejected
    for r in out.preempted:
        assert r.status is RequestStatus.WAITING and r.num_computed_tokens == 0
    for r in out.rejected:
        assert not kv.fits_ever(r.num_tokens + 1)


def _check_accounting(sched: Scheduler, requests: list[Request]) -> None:
    kv = sched.kv
    owned = [b for r in sched.running for b in r.block_ids]
    assert len(owned) == len(set(owned)), "a block is owned by two requests"
    assert kv.pool.num_used == len(owned), "blocks used != blocks owned by running requests"
    assert kv.pool.ref_cnt == [1 if b in owned else 0 for b in range(kv.num_blocks)]
    for r in sched.running:
        assert r.status is RequestStatus.RUNNING
        assert len(r.block_ids) == kv.blocks_for(r.num_computed_tokens)
    for r in sched.waiting:
        assert r.status is RequestStatus.WAITING
        assert r.block_ids == [] and r.num_computed_tokens == 0
    for r in requests:
        if r.finished:
            assert r.block_ids == [] and r not in sched.running and r not in sched.waiting


@settings(
    max_examples=400,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    arrivals=st.lists(arrival, min_size=1, max_size=10),
    num_blocks=st.integers(1, 12),
    block_size=st.sampled_from([1, 2, 4, 8]),
    budget=st.integers(1, 64),
    max_num_seqs=st.integers(1, 4),
)
def test_random_workload_accounts_for_everything(
    arrivals, num_blocks, block_size, budget, max_num_seqs
):
    sched = make_scheduler(num_blocks, block_size, budget, max_num_seqs)
    requests = [
        make_request(str(i), n, max_tokens) for i, (n, max_tokens, *_) in enumerate(arrivals)
    ]
    added, aborted, rejected = set(), set(), set()
    last_arrival = max(a[2] for a in arrivals)
    # The oldest running request is never another's victim, so it computes a token of its own
    # every step (or, alone and too big, preempts itself and is rejected the step after): the
    # work is bounded by the tokens every request could ever hold.
    max_steps = last_arrival + sum(n + m for n, m, *_ in arrivals) + 2 * len(arrivals) + 1
    for t in range(max_steps + 1):
        for r, (_, _, arrive, abort_at) in zip(requests, arrivals, strict=True):
            if arrive == t:
                sched.add(r)
                added.add(r.request_id)
            if abort_at == t and r.request_id in added and not r.finished:
                sched.finish(r, "abort")
                aborted.add(r.request_id)
        _check_accounting(sched, requests)
        before_running, before_waiting = list(sched.running), list(sched.waiting)
        out = schedule(sched)
        _check_step(sched, out, before_running, before_waiting, budget)
        run(sched, out, PROP_MAX_MODEL_LEN)
        rejected.update(ids(out.rejected))
        _check_accounting(sched, requests)
        if t >= last_arrival and not sched.has_unfinished():
            break
    assert not sched.has_unfinished(), "the scheduler stopped making progress"
    for what, happened in (
        ("a preemption", sched.num_preemptions),
        ("a rejection", rejected),
        ("an abort", aborted),
    ):
        event(f"with {what}" if happened else f"without {what}")
    for r in requests:
        assert r.finished
        if r.request_id in aborted:
            assert r.finish_reason == "abort"
        elif r.request_id in rejected:
            assert r.finish_reason == "error"
        else:
            assert r.finish_reason == "length"
            assert r.num_output_tokens == r.max_tokens or r.num_tokens == PROP_MAX_MODEL_LEN
    assert sched.kv.pool.num_used == 0 and sched.kv.pool.num_free == num_blocks
    assert sched.kv.pool.ref_cnt == [0] * num_blocks
