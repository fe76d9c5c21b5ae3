"""The engine's API on a tiny random model: request ids, max_tokens=None, a pool smaller than
the context, and what the step loop hands back."""

import logging
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import TINY_MAX_LEN
from tinyllm.engine.config import EngineConfig
from tinyllm.engine.engine import LLMEngine
from tinyllm.engine.sampling_params import RequestOutputKind, SamplingParams
from tinyllm.engine.structured_output.params import StructuredOutputsParams


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


def test_a_pool_smaller_than_the_context_cuts_max_model_len_and_keeps_the_text(tiny, caplog):
    with caplog.at_level(logging.WARNING, logger="tinyllm"):
        engine = _engine(tiny, num_blocks=4, block_size=4)
    assert "holds 16 tokens, fewer than the context (48): max_model_len is cut to 16" in caplog.text
    assert engine.max_model_len == 16
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    engine.add_request(None, params, request_id="long", prompt_token_ids=[5] * 10)
    out = _drain(engine)["long"]
    # It ran until the pool was full, and finished there with what it made.
    assert out.finish_reason == "length" and out.error is None
    assert len(out.token_ids) == 6 and engine.kv.pool.num_used == 0
    with pytest.raises(ValueError, match="prompt is 16 tokens, but this model's context is 16"):
        engine.add_request(None, params, prompt_token_ids=[5] * 16)
    assert not engine.has_unfinished()


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_n_completions_are_one_request_with_numbered_outputs(tiny, kind):
    """The step API expands n itself: one request id, n completions numbered 0..n-1, each
    sampled with its own seed (seed + i), whatever the output kind."""
    engine = _engine(tiny, max_num_batched_tokens=4)
    params = SamplingParams(
        max_tokens=5, temperature=1.0, seed=2**63 - 2, n=3, ignore_eos=True, output_kind=kind
    )
    engine.add_request(None, params, request_id="p", prompt_token_ids=list(range(2, 12)))
    assert len(engine.requests) == 3
    tokens: dict[int, list[int]] = {0: [], 1: [], 2: []}
    finals = []
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id == "p"
            for c in out.outputs:
                if kind is RequestOutputKind.DELTA:
                    tokens[c.index] += c.token_ids
                else:
                    tokens[c.index] = c.token_ids
            finals.append(out.finished)
    assert finals[-1] and not any(finals[:-1])
    if kind is RequestOutputKind.FINAL_ONLY:
        assert len(finals) == 1
    assert all(len(t) == 5 for t in tokens.values())
    for i in range(3):  # the seed wraps past 2**63 - 1 instead of overflowing
        seed = (2**63 - 2 + i + 2**63) % 2**64 - 2**63
        alone = _engine(tiny)
        one = SamplingParams(max_tokens=5, temperature=1.0, seed=seed, ignore_eos=True)
        alone.add_request(None, one, request_id="a", prompt_token_ids=list(range(2, 12)))
        assert _drain(alone)["a"].token_ids == tokens[i]
    assert engine.kv.pool.num_used == 0 and not engine.parents and not engine.requests


def test_aborting_an_n_request_aborts_every_completion(tiny):
    engine = _engine(tiny)
    params = SamplingParams(max_tokens=20, temperature=1.0, n=4, ignore_eos=True)
    engine.add_request(None, params, request_id="p", prompt_token_ids=[3, 4, 5])
    engine.step()
    out = engine.abort("p")
    assert out.request_id == "p" and out.finished
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert {c.finish_reason for c in out.outputs} == {"abort"}
    assert engine.kv.pool.num_used == 0 and not engine.has_unfinished() and not engine.parents
    engine.add_request(None, GREEDY, request_id="q[1]", prompt_token_ids=[3])
    with pytest.raises(ValueError, match="already in use"):  # its completion 1's id is taken
        engine.add_request(None, params, request_id="q", prompt_token_ids=[3])
    assert engine.abort("q[1]").finish_reason == "abort"
    assert not engine.has_unfinished()


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


def test_an_error_inside_a_step_ends_only_the_request_it_concerns(tiny, caplog):
    """A request whose sampling raises (a stand-in for any failure in a step) ends with an
    error and gives its blocks back; the requests batched with it finish as they would have,
    and the engine serves the next request."""
    engine = _engine(tiny)
    sampler = engine.runner.sampler
    sample = sampler.verify

    def poisoned(logits, requests, *args):
        if any(r.req_id == "bad" for r in requests):
            raise RuntimeError("boom")
        return sample(logits, requests, *args)

    sampler.verify = poisoned
    for rid in ("a", "bad", "b"):
        engine.add_request(None, GREEDY, request_id=rid, prompt_token_ids=[3, 4, 5, 6, 7])
    with caplog.at_level(logging.ERROR, logger="tinyllm"):
        done = _drain(engine)
    assert "request bad failed in a step" in caplog.text and "boom" in caplog.text
    assert done["bad"].finish_reason == "error" and "engine failed" in done["bad"].error
    reference = _engine(tiny)
    reference.add_request(None, GREEDY, request_id="a", prompt_token_ids=[3, 4, 5, 6, 7])
    expected = _drain(reference)["a"].token_ids
    assert done["a"].token_ids == done["b"].token_ids == expected
    assert engine.kv.pool.num_used == 0 and not engine.requests
    engine.add_request(None, GREEDY, request_id="next", prompt_token_ids=[3, 4, 5, 6, 7])
    assert _drain(engine)["next"].token_ids == expected


def test_a_step_of_prompt_chunks_only_never_runs_the_lm_head(tiny, monkeypatch):
    """No row samples after a chunk that leaves the prompt unfinished: the LM head is not run
    (on zero rows it once divided by zero in the int4 kernel and killed the process)."""
    engine = _engine(tiny, max_num_batched_tokens=4)
    model = engine.runner.model
    rows = []
    logits = model.logits
    monkeypatch.setattr(model, "logits", lambda h: rows.append(len(h)) or logits(h))
    engine.add_request(None, GREEDY, request_id="a", prompt_token_ids=list(range(2, 13)))
    out = _drain(engine)["a"]
    assert len(out.token_ids) == 4
    assert rows == [1, 1, 1, 1]  # 11 tokens in chunks of 4: two steps without a row to sample


def test_outputs_steps_until_nothing_is_left_and_shows_prefill_progress(tiny):
    """outputs() yields each step's outputs while any request is unfinished, a request added
    between two steps included; num_computed_tokens follows a prompt's prefill chunk by chunk."""
    engine = _engine(tiny, max_num_batched_tokens=4)
    engine.add_request(None, GREEDY, request_id="a", prompt_token_ids=list(range(2, 12)))
    progress, done = [], {}
    for outputs in engine.outputs():
        progress.append(engine.num_computed_tokens("a"))
        done |= {out.request_id: out for out in outputs if out.finished}
        if len(progress) == 1:
            engine.add_request(None, GREEDY, request_id="b", prompt_token_ids=[3, 4])
    assert progress[:3] == [4, 8, 10] and progress[-1] is None  # 10 tokens in chunks of 4
    assert sorted(done) == ["a", "b"] and not engine.has_unfinished()
    assert list(engine.outputs()) == []


def test_abort_all_ends_every_request_and_frees_every_block(tiny):
    engine = _engine(tiny)
    n = SamplingParams(max_tokens=20, temperature=1.0, n=3, ignore_eos=True)
    engine.add_request(None, n, request_id="p", prompt_token_ids=[3, 4, 5])
    engine.add_request(None, GREEDY, request_id="a", prompt_token_ids=[6, 7])
    engine.step()
    outs = engine.abort_all()
    assert sorted(o.request_id for o in outs) == ["a", "p"]
    assert {c.finish_reason for o in outs for c in o.outputs} == {"abort"}
    assert engine.kv.pool.num_used == 0 and not engine.has_unfinished() and not engine.parents
    assert engine.abort_all() == []


def test_the_request_validator_refuses_what_add_request_refuses_from_another_thread(tiny):
    engine = _engine(tiny)
    validator = engine.request_validator()
    assert validator.limits.max_model_len == TINY_MAX_LEN
    assert validator.limits.vocab_size == engine.vocab_size
    bad = [
        ([], GREEDY),
        ([5] * TINY_MAX_LEN, GREEDY),
        ([3, 99], GREEDY),
        ([3], SamplingParams(stop_token_ids=[64])),
        ([3], SamplingParams(structured_outputs=StructuredOutputsParams(regex="(["))),
    ]
    with ThreadPoolExecutor(1) as pool:
        for ids, params in bad:
            with pytest.raises(ValueError) as from_engine:
                engine.add_request(None, params, prompt_token_ids=ids)
            with pytest.raises(ValueError, match=re.escape(str(from_engine.value))):
                pool.submit(validator.validate, ids, params).result()
    assert not engine.has_unfinished()
    validator.validate([3, 4], GREEDY)  # a request that can run passes


def test_with_config_is_a_fresh_engine_over_the_same_model(tiny):
    engine = _engine(tiny, num_blocks=16)
    engine.add_request(None, GREEDY, request_id="a", prompt_token_ids=[3, 4, 5, 6])
    expected = _drain(engine)["a"].token_ids
    other = engine.with_config(enable_prefix_caching=False)
    assert other.stats().generation_tokens == 0 and other.kv.pool.num_blocks == 16
    assert not other.kv.enable_prefix_caching and engine.kv.enable_prefix_caching
    other.add_request(None, GREEDY, request_id="a", prompt_token_ids=[3, 4, 5, 6])
    assert _drain(other)["a"].token_ids == expected
