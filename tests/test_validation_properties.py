"""Whatever a user hands `LLM.generate` on the default configuration is refused at once with an
error naming the field, with nothing queued, or it runs to completion; either way the LLM
answers the next request as before. (Wrong types used to pass and then raise inside step(),
which left the LLM broken for good.)"""

import math
import re

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from tinyllm.engine.engine import LLMEngine
from tinyllm.engine.sampling_params import LOGIT_BIAS_LIMIT, SamplingParams
from tinyllm.engine.validation import is_int

pytestmark = pytest.mark.slow

VOCAB = 49152  # the default model's
GREEDY = SamplingParams(temperature=0, max_tokens=2)
NORMAL = "The capital of France is"  # the greedy request the LLM must still answer
TOO_LONG = "<a prompt of max_model_len tokens>"  # stands for one, made in the test

HUGE_INTS = st.one_of(st.integers(2**63 - 2, 2**70), st.integers(-(2**70), -1))
NUMBERS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -math.inf, 1e300, 2.5]),
)
# Values of every wrong kind, alone or in a list or a dict; some are right for some fields,
# which then run.
KEY = st.one_of(
    st.booleans(), NUMBERS, st.text(max_size=2), st.none(), HUGE_INTS, st.integers(-3, VOCAB + 3)
)
ITEM = st.one_of(KEY, st.lists(st.integers(0, 9), max_size=2))
JUNK = st.one_of(
    ITEM,
    st.lists(ITEM, min_size=1, max_size=3),
    st.dictionaries(KEY, ITEM, min_size=1, max_size=2),
)
# Right values, small enough to run fast.
VALID = {
    "max_tokens": st.integers(1, 2),
    "temperature": st.sampled_from([0, 0.0, 0.8, 1]),
    "top_k": st.sampled_from([-1, 0, 5, 10**30]),
    "top_p": st.floats(0.05, 1),
    "min_p": st.floats(0, 0.5),
    "seed": st.one_of(st.none(), st.integers(-(2**63), 2**63 - 2)),  # seed + 1 for n=2
    "stop": st.sampled_from([None, [], "e", ("\n", " the")]),
    "stop_token_ids": st.sampled_from([None, [], [2], (13, 28)]),
    "ignore_eos": st.booleans(),
    "repetition_penalty": st.floats(0.5, 2),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "logprobs": st.one_of(st.none(), st.integers(0, 20)),
    "logit_bias": st.one_of(
        st.none(),
        st.dictionaries(
            st.integers(0, VOCAB - 1), st.floats(-LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT), max_size=3
        ),
    ),
    "skip_special_tokens": st.booleans(),
    "n": st.integers(1, 2),
}


# The fields with items have the most ways to be wrong: they come up four times as often.
JUNK_FIELDS = [*VALID, *["stop", "stop_token_ids", "logit_bias"] * 3]


def _junk(field: str) -> st.SearchStrategy:
    if field == "max_tokens":  # not None or a big count: right, but slow to run
        return JUNK.filter(lambda v: not (v is None or (is_int(v) and v > 2)))
    if field == "logit_bias":  # right token ids too, so that a wrong bias is what it tries
        return st.one_of(
            JUNK, st.dictionaries(st.integers(0, VOCAB - 1), ITEM, min_size=1, max_size=2)
        )
    return JUNK


TOKEN = st.one_of(st.integers(0, VOCAB - 1), ITEM)
GOOD_PROMPT = st.one_of(
    st.text(min_size=1, max_size=12), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=5)
)
BAD_PROMPT = st.one_of(
    st.text(max_size=6).map(lambda t: t + "\ud800"),  # a lone surrogate: not text
    st.sampled_from(["", [], TOO_LONG]),
    st.lists(TOKEN, min_size=1, max_size=5),
    st.tuples(st.integers(0, VOCAB - 1), TOKEN).map(list),
)


@st.composite
def submissions(draw) -> tuple[set[str], dict, list, bool]:
    """Every field set right and one or two right prompts; then, about half the time each, up
    to two fields (named in the set) set to anything at all and one prompt swapped for a
    wrong one (the bool says so)."""
    junk = set()
    if draw(st.booleans()):
        junk = draw(st.sets(st.sampled_from(JUNK_FIELDS), min_size=1, max_size=2))
    kwargs = {f: draw(_junk(f) if f in junk else VALID[f]) for f in VALID}
    prompts = draw(st.lists(GOOD_PROMPT, min_size=1, max_size=2))
    bad_prompt = draw(st.booleans())
    if bad_prompt:
        prompts[draw(st.integers(0, len(prompts) - 1))] = draw(BAD_PROMPT)
    return junk, kwargs, prompts, bad_prompt


BASE = dict(max_tokens=2, temperature=0.8, seed=1, logprobs=1, n=2)  # set, the rest default


def _known(prompts: list | None = None, **field) -> dict:
    """A submission that once broke the LLM: `field` (at most one) wrong, or the prompts."""
    return dict(case=(set(field), {**BASE, **field}, prompts or ["Hi"], prompts is not None))


# What used to pass the checks and then raise inside step(), or was taken though wrong.
KNOWN = [
    _known(logit_bias=[1, 2]),
    _known(logit_bias={12.7: 5.0}),
    _known(logit_bias={12: "5"}),
    _known(logit_bias={12: math.nan}),
    _known(logit_bias={12: 1e300}),
    _known(logprobs=2.5),
    _known(logprobs=True),
    _known(top_k=2.5),
    _known(top_k=True),
    _known(seed=1.5),
    _known(temperature="0.5"),
    _known(stop=None),
    _known(stop_token_ids=5),
    _known(stop_token_ids=[True]),
    _known(prompts=[[1, 2.5, 3]]),
    _known(prompts=["ok", [True, 2]]),
    _known(prompts=["\ud800"]),
]


def _with_known(test):
    for known in KNOWN:
        test = example(**known)(test)
    return test


def _assert_idle(engine: LLMEngine) -> None:
    assert not engine.scheduler.waiting and not engine.scheduler.running
    assert not engine.requests and engine.kv.pool.num_used == 0


@pytest.fixture(scope="module")
def reference(default_config_llm) -> list[int]:
    tokens = default_config_llm.generate(NORMAL, GREEDY, use_tqdm=False)
    assert len(tokens[0].token_ids) == 2
    return tokens[0].token_ids


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=submissions())
@_with_known
def test_anything_is_refused_by_name_or_runs(default_config_llm, reference, case):
    llm = default_config_llm
    junk, kwargs, prompts, bad_prompt = case
    prompts = [[1] * llm.engine.max_model_len if p == TOO_LONG else p for p in prompts]
    # Text of characters the vocabulary lacks ("\x16" for the default model) is no tokens.
    if not bad_prompt:  # (a bad prompt may be no text at all: not for the tokenizer)
        bad_prompt = any(isinstance(p, str) and not llm.tokenizer.encode(p) for p in prompts)
    try:
        params = SamplingParams(**kwargs)
    except (ValueError, TypeError) as e:
        named = re.match(r"SamplingParams\.(\w+)", str(e))
        assert named and named.group(1) in junk, repr(e)
        event("refused by SamplingParams")
    else:
        try:
            outputs = llm.generate(prompts, params, use_tqdm=False)
        except (ValueError, TypeError) as e:
            assert junk or bad_prompt, repr(e)
            # Only the engine knows the vocabulary, and the prompts.
            named = r"(SamplingParams\.(stop_token_ids|logit_bias)|prompt|the prompt)\b"
            assert re.match(named, str(e)), repr(e)
            event("refused by LLM.generate")
        else:
            assert len(outputs) == len(prompts)
            for out in outputs:
                assert len(out.outputs) == params.n
                assert all(c.finish_reason in ("stop", "length") for c in out.outputs)
            event("ran")
    _assert_idle(llm.engine)
    assert llm.generate(NORMAL, GREEDY, use_tqdm=False)[0].token_ids == reference


def test_text_that_is_not_unicode_names_prompt_or_messages(default_config_llm):
    llm = default_config_llm
    with pytest.raises(ValueError, match=r"^prompt: not valid Unicode text"):
        llm.generate(["fine", "a\ud800"], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=r"^messages: not valid Unicode text"):
        llm.chat([{"role": "user", "content": "\udc00"}], GREEDY, use_tqdm=False)
    _assert_idle(llm.engine)


def test_text_the_vocabulary_cannot_encode_is_refused_by_name(default_config_llm):
    """The default model's byte-level vocabulary lacks byte 0x16: the tokenizer drops it, so
    such a prompt is no tokens, which is said as such (not as an empty prompt)."""
    llm = default_config_llm
    assert llm.tokenizer.encode("\x16") == []
    with pytest.raises(ValueError, match=r"^the prompt '\\x16' is no tokens: this model's"):
        llm.generate(["fine", "\x16"], GREEDY, use_tqdm=False)
    _assert_idle(llm.engine)
