"""The engine's API on a tiny random model: request ids, max_tokens=None, a pool smaller than
the context, and what the step loop hands back."""

import logging

import pytest

from tests.conftest import TINY_MAX_LEN
from tinyllm.engine.config import EngineConfig
from tinyllm.engine.engine import LLMEngine
from tinyllm.engine.sampling_params import RequestOutputKind, SamplingParams


def _engine(tiny, **kw) -> LLMEngine:
    model, tok = tiny
    return LLMEngine(model, tok, EngineConfig(**kw))


def _drain(engine: LLMEngine) -> dict:
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                assert out.request_id not in done
                done[out.request_id] = out
    return done


GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def test_a_duplicate_request_id_is_refused_and_loses_nothing(tiny):
    engine = _engine(tiny)
    engine.add_request(None, GREEDY, request_id="a", prompt_token_ids=[3, 4, 5])
    with pytest.raises(ValueError, match="request id 'a' is already in use"):
        engine.add_request(None, GREEDY, request_id="a", prompt_token_ids=[6, 7])
    done = _drain(engine)
    assert list(done) == ["a"] and len(done["a"].token_ids) == 4
    # Once finished, the id is free again.
    engine.add_request(None, GREEDY, request_id="a", prompt_token_ids=[6, 7])
    assert engine.abort("a").finish_reason == "abort" and engine.abort("a") is None


def test_auto_ids_never_collide_with_user_ids(tiny):
    engine = _engine(tiny)
    ids = [engine.add_request(None, GREEDY, request_id="1", prompt_token_ids=[3])]
    ids += [engine.add_request(None, GREEDY, prompt_token_ids=[3]) for _ in range(3)]
    assert len(set(ids)) == 4
    assert sorted(_drain(engine)) == sorted(ids)


def test_max_tokens_none_runs_to_the_context(tiny):
    engine = _engine(tiny)
    params = SamplingParams(max_tokens=None, temperature=0, ignore_eos=True)
    engine.add_request(None, params, request_id="r", prompt_token_ids=[5] * 10)
    out = _drain(engine)["r"]
    assert out.finish_reason == "length" and len(out.token_ids) == TINY_MAX_LEN - 10


def test_a_pool_smaller_than_the_context_warns_and_names_the_limit(tiny, caplog):
    with caplog.at_level(logging.WARNING, logger="tinyllm"):
        engine = _engine(tiny, num_blocks=4, block_size=4)
    assert "holds 16 tokens, fewer than max_model_len 48" in caplog.text
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    engine.add_request(None, params, request_id="long", prompt_token_ids=[5] * 10)
    out = _drain(engine)["long"]
    # It ran until it outgrew the pool (16 tokens computed, the 17th sampled), then failed
    # with the numbers, keeping what it made.
    assert out.finish_reason == "error" and "the whole cache holds 16" in out.error
    assert len(out.token_ids) == 7 and engine.kv.pool.num_used == 0


def test_delta_outputs_carry_only_the_new_tokens(tiny):
    engine = _engine(tiny, max_num_batched_tokens=4)
    delta = SamplingParams(
        max_tokens=6, temperature=0, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    engine.add_request(None, delta, request_id="d", prompt_token_ids=list(range(2, 12)))
    engine.add_request(None, GREEDY, request_id="c", prompt_token_ids=list(range(2, 12)))
    seen = {"d": [], "c": []}
    while engine.has_unfinished():
        for out in engine.step():
            seen[out.request_id].append(out.token_ids)
    # A 10-token prompt in chunks of 4 makes no output until its last chunk has run.
    assert [len(t) for t in seen["d"]] == [1] * 6
    assert [len(t) for t in seen["c"]] == [1, 2, 3, 4]
    assert sum(seen["d"], [])[:4] == seen["c"][-1]  # same prompt, same greedy tokens
