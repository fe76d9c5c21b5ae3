"""The offline Python API on the default model: n completions per prompt, and a bad prompt
refusing the whole call without leaving anything running."""

import pytest

from tinyllm import SamplingParams

pytestmark = pytest.mark.slow


def test_n_completions_per_prompt(default_llm):
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    prompts = ["The capital of France is", "Once upon a time"]
    first = default_llm.generate(prompts, params, use_tqdm=False)
    again = default_llm.generate(prompts, params, use_tqdm=False)
    for out, out2 in zip(first, again, strict=True):
        assert [c.index for c in out.outputs] == [0, 1, 2]
        assert all(len(c.token_ids) == 8 for c in out.outputs)
        # Each completion draws from its own seed: not three copies, and reproducible.
        assert len({tuple(c.token_ids) for c in out.outputs}) > 1
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in out2.outputs]
    assert first[0].prompt == prompts[0]
    one = default_llm.generate(prompts[0], SamplingParams(seed=5, max_tokens=8, ignore_eos=True))
    assert one[0].token_ids == first[0].outputs[0].token_ids  # completion 0 is seed 5's draw


def test_a_bad_prompt_refuses_the_whole_call(default_llm):
    engine = default_llm.engine
    too_long = [5] * engine.max_model_len
    with pytest.raises(ValueError, match="prompt is 2048 tokens"):
        default_llm.generate([[5, 6, 7], too_long], SamplingParams(n=2), use_tqdm=False)
    assert not engine.has_unfinished() and not engine.requests
    assert engine.kv.pool.num_used == 0


@pytest.mark.parametrize("prompts", [None, 5, [], [None], [[1, 2], None], {"a": 1}])
def test_prompts_of_the_wrong_shape_name_prompts(default_llm, prompts):
    with pytest.raises(ValueError, match="prompts: give a text, a list of token ids"):
        default_llm.generate(prompts, use_tqdm=False)
    assert not default_llm.engine.has_unfinished()


def test_a_float_among_token_ids_names_the_prompt(default_llm):
    with pytest.raises(ValueError, match="prompt"):
        default_llm.generate([2.5, 3], use_tqdm=False)
    assert not default_llm.engine.has_unfinished()
