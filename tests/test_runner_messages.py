"""The model runner driven by nothing but step messages built by hand (no scheduler, no
Request objects), each pickled on the way as it is to a tensor-parallel worker: it gives the
engine's tokens and logprobs on the default configuration, takes an entry sent twice (the
engine's retry of a failed step) as once, and forgets finished requests."""

import pickle

import pytest

from tests.engine_runs import engine_on, run_all
from tinyllm.engine.sampling_params import SamplingParams
from tinyllm.engine.step_message import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from tinyllm.engine.worker.model_runner import ModelRunner
from tinyllm.model.attention import get_backend

BLOCK = 16
PARAMS = SamplingParams(max_tokens=5, temperature=0, logprobs=2, ignore_eos=True)
PROMPTS = {"a": list(range(300, 340)), "b": list(range(1000, 1025))}


class HandScheduler:
    """Just enough scheduling for the test: fixed blocks per request, the messages by hand."""

    def __init__(self) -> None:
        self.blocks = {"a": [3, 7, 1, 8], "b": [5, 0, 2]}  # any order: block tables are paged
        self.tokens = {rid: list(p) for rid, p in PROMPTS.items()}
        self.computed = dict.fromkeys(PROMPTS, 0)
        self.sent = dict.fromkeys(PROMPTS, 0)

    def message(self, scheduled: dict[str, int], finished: list[str] = ()) -> SchedulerOutput:
        out = SchedulerOutput(finished_req_ids=list(finished))
        for rid, n in scheduled.items():
            if self.sent[rid] == 0:
                new = NewRequestData(rid, PROMPTS[rid], PARAMS, 7, self.blocks[rid])
                out.new_requests.append(new)
            else:
                at = self.sent[rid]
                cached = CachedRequestData(rid, at, self.tokens[rid][at:], 0, self.blocks[rid])
                out.cached_requests.append(cached)
            self.sent[rid] = len(self.tokens[rid])
            out.num_scheduled_tokens[rid] = n
            out.num_computed_tokens[rid] = self.computed[rid]
        return pickle.loads(pickle.dumps(out))

    def update(self, scheduled: dict[str, int], result: ModelRunnerOutput) -> None:
        for rid, n in scheduled.items():
            self.computed[rid] += n
        for rid, (token,) in zip(result.req_ids, result.sampled_token_ids, strict=True):
            self.tokens[rid].append(token)


@pytest.fixture
def runner(default_config_llm):
    model = default_config_llm.engine.model
    return ModelRunner(model, 16, BLOCK, get_backend("auto", model.device))


def test_messages_alone_run_the_engines_steps(default_config_llm, runner):
    """a's prompt in one step, b's in two chunks beside a's decodes, then both decode: the
    same tokens and the same logprob bits as the engine on the same weights."""
    ref = run_all(engine_on(default_config_llm), list(PROMPTS.values()), PARAMS)
    hand = HandScheduler()
    logprobs: dict[str, list] = {"a": [], "b": []}
    steps = [{"a": 40, "b": 9}, {"a": 1, "b": 16}] + [{"a": 1, "b": 1}] * 4 + [{"b": 1}]
    for scheduled in steps:
        result = pickle.loads(pickle.dumps(runner.execute_model(hand.message(scheduled))))
        for rid, lps in zip(result.req_ids, result.logprobs, strict=True):
            logprobs[rid] += lps
        hand.update(scheduled, result)
    for rid, want in zip(PROMPTS, ref, strict=True):
        got = hand.tokens[rid][len(PROMPTS[rid]) :]
        assert got[: PARAMS.max_tokens] == list(want.outputs[0].token_ids)
        assert logprobs[rid][: PARAMS.max_tokens] == want.outputs[0].logprobs
    assert set(runner.requests) == {"a", "b"}
    runner.update_states(hand.message({}, finished=["a", "b", "never-seen"]))
    assert runner.requests == {}


def test_an_entry_sent_again_is_taken_once(runner):
    """The engine reruns a failed step's requests alone with the entries already sent: the
    state they leave, and the step's tokens, are those of one application."""
    hand = HandScheduler()
    first = hand.message({"a": 40})
    hand.update({"a": 40}, runner.execute_model(first))
    decode = hand.message({"a": 1})
    once = runner.execute_model(decode)
    state = (list(runner.requests["a"].token_ids), list(runner.requests["a"].block_ids))
    again = runner.execute_model(decode.only("a"))
    assert again.sampled_token_ids == once.sampled_token_ids
    assert (runner.requests["a"].token_ids, runner.requests["a"].block_ids) == state
    assert state[0] == hand.tokens["a"] and len(state[0]) == len(PROMPTS["a"]) + 1
