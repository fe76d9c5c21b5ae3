"""SamplingParams(prompt_logprobs=k) on the default configuration: every prompt token after the
first gets its logprob under the tokens before it, the same bits however the prompt is chunked,
preempted or already cached, and equal to what decoding reports for the same position."""

import pytest

from tests.engine_runs import engine_on, run_all
from tests.test_default_config import _random_prompts
from tinyllm.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

PROMPT_LP = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=3)


def _table(out) -> list:
    return [None if lp is None else (lp.token_id, lp.logprob, lp.top) for lp in out.prompt_logprobs]


def test_one_logprob_per_prompt_token_and_the_first_has_none(default_config_llm):
    prompt = _random_prompts(1, [40])[0]
    out = default_config_llm.generate([prompt], PROMPT_LP, use_tqdm=False)[0]
    lps = out.prompt_logprobs
    assert len(lps) == len(prompt) and lps[0] is None
    assert [lp.token_id for lp in lps[1:]] == prompt[1:]
    for lp in lps[1:]:
        assert lp.logprob <= 0 and len(lp.top) == 3
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1] >= lp.logprob or lp.token_id in {
            t for t, _ in lp.top
        }
    # Asked for nothing, nothing is computed.
    plain = default_config_llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)
    assert plain[0].prompt_logprobs is None


def test_prompt_logprobs_equal_what_decoding_reports_for_the_same_position(default_config_llm):
    """Position k's prompt logprobs come from a prompt chunk; the same distribution reached by
    a request whose prompt ends at k comes from its last row: the default path computes every
    query by one routine, so the top alternatives are the same bits."""
    prompt = _random_prompts(1, [30], seed=3)[0]
    full = default_config_llm.generate([prompt], PROMPT_LP, use_tqdm=False)[0]
    for k in (5, 17, 29):
        params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, logprobs=3)
        head = default_config_llm.generate([prompt[:k]], params, use_tqdm=False)[0]
        assert head.outputs[0].logprobs[0].top == full.prompt_logprobs[k].top


def test_the_same_bits_chunked_preempted_or_with_the_prompt_cached(default_config_llm):
    prompts = _random_prompts(6, [40], seed=3)
    ref = [_table(o) for o in run_all(engine_on(default_config_llm), prompts, PROMPT_LP)]
    chunked = run_all(engine_on(default_config_llm, max_num_batched_tokens=16), prompts, PROMPT_LP)
    assert [_table(o) for o in chunked] == ref
    # As tests/test_default_config.py's preemption test: prompts growing by 48 tokens in 12
    # blocks of 16, preempted mid-prefill too; a recompute adds no logprob twice.
    grow = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True, prompt_logprobs=3)
    tight = engine_on(default_config_llm, num_blocks=12, max_num_seqs=8, max_num_batched_tokens=32)
    assert [_table(o) for o in run_all(tight, prompts, grow)] == ref
    assert tight.stats().num_preemptions > 0
    # The same prompts again with their blocks in the prefix cache: not read from it (cached
    # tokens have no logits), every logprob computed again.
    warm = engine_on(default_config_llm)
    run_all(warm, prompts, SamplingParams(max_tokens=1))
    again = run_all(warm, prompts, PROMPT_LP)
    assert [_table(o) for o in again] == ref
    assert [o.num_cached_tokens for o in again] == [0] * len(prompts)


def test_prompt_logprobs_is_checked():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
