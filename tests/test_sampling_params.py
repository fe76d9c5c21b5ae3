"""SamplingParams and token ids: validation that names the field, greedy, and the vLLM-style
fields."""

import math
import re

import pytest

from tinyllm.engine.sampling_params import LOGIT_BIAS_LIMIT, RequestOutputKind, SamplingParams
from tinyllm.engine.validation import check_token_ids

INF, NAN = math.inf, math.nan


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("max_tokens", 2.5),
        ("max_tokens", True),
        ("max_tokens", "3"),
        ("temperature", -0.5),
        ("temperature", "0.5"),
        ("temperature", True),
        ("temperature", NAN),
        ("temperature", INF),
        ("temperature", None),
        ("top_p", 0.0),
        ("top_p", NAN),
        ("top_p", [0.5]),
        ("top_k", -2),
        ("top_k", 2.5),
        ("top_k", True),
        ("top_k", "5"),
        ("min_p", 1.5),
        ("min_p", "0"),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", INF),
        ("presence_penalty", 3.0),
        ("frequency_penalty", -INF),
        ("logprobs", 21),
        ("logprobs", -1),
        ("logprobs", 2.5),
        ("logprobs", True),
        ("stop", [""]),
        ("stop", 5),
        ("stop", [None]),
        ("stop", ["ok", 3]),
        ("stop", b"x"),
        ("stop_token_ids", 5),
        ("stop_token_ids", [True]),
        ("stop_token_ids", [1.0]),
        ("stop_token_ids", [[1]]),
        ("stop_token_ids", "12"),
        ("seed", 2**64),
        ("seed", -(2**63) - 1),
        ("seed", 1.5),
        ("seed", True),
        ("ignore_eos", "yes"),
        ("ignore_eos", 1),
        ("skip_special_tokens", None),
        ("logit_bias", [1, 2]),
        ("logit_bias", {12.7: 5.0}),
        ("logit_bias", {True: 5.0}),
        ("logit_bias", {"12": 5.0}),
        ("logit_bias", {12: "5"}),
        ("logit_bias", {12: None}),
        ("logit_bias", {12: NAN}),
        ("logit_bias", {12: INF}),
        ("logit_bias", {12: 1e300}),
        ("logit_bias", {12: LOGIT_BIAS_LIMIT + 0.5}),
        ("logit_bias", {12: -LOGIT_BIAS_LIMIT - 0.5}),
        ("n", 0),
        ("n", 257),
        ("n", 2.0),
        ("n", True),
        ("output_kind", "delta"),
        ("output_kind", 1),
    ],
)
def test_invalid_params_name_the_field(field, value):
    """A wrong type or a value out of range: a ValueError naming the field and the rule (for a
    list or dict, the item and where it is), never an error from deep in the engine later."""
    with pytest.raises(ValueError, match=rf"^SamplingParams\.{field}\b.* must be ") as e:
        SamplingParams(**{field: value})
    if not isinstance(value, list | dict):  # a list's or a dict's message shows the bad item
        assert repr(value) in str(e.value)


@pytest.mark.parametrize(
    ("value", "shown"),
    [({12.7: 5.0}, "logit_bias key=12.7"), ({3: 1, 12: "5"}, "logit_bias[12]='5'")],
)
def test_logit_bias_errors_show_the_entry(value, shown):
    with pytest.raises(ValueError, match=re.escape(f"SamplingParams.{shown} must be")):
        SamplingParams(logit_bias=value)


def test_messages_stay_short_for_huge_values():
    with pytest.raises(ValueError, match=r"SamplingParams\.temperature='9+\.\.\.9+' must") as e:
        SamplingParams(temperature="9" * 10**6)
    assert len(str(e.value)) < 200
    with pytest.raises(ValueError, match=r"seed=<an int of 33220 bits>"):
        SamplingParams(seed=10**10000)  # too long for Python to print


def test_valid_edges_and_normal_forms():
    assert SamplingParams(logit_bias={5: LOGIT_BIAS_LIMIT, 6: -LOGIT_BIAS_LIMIT, 7: 0}).logit_bias
    assert SamplingParams(top_k=-1).top_k == 0
    p = SamplingParams(stop=None, stop_token_ids=None, logit_bias=None)  # None: none, as in vLLM
    assert (p.stop, p.stop_token_ids, p.logit_bias) == ([], [], {})
    p = SamplingParams(stop="end", stop_token_ids=(2, 3), temperature=1, top_p=1)
    assert p.stop == ["end"] and p.stop_token_ids == [2, 3]
    # The params keep their own copies: changing the caller's list later cannot undo a check.
    stop, bias = ["end"], {1: 2.0}
    p = SamplingParams(stop=stop, logit_bias=bias)
    stop.append("")
    bias[1] = math.nan
    assert p.stop == ["end"] and p.logit_bias == {1: 2.0}


@pytest.mark.parametrize(
    ("temperature", "greedy"), [(0, True), (1e-38, True), (9e-6, True), (1e-4, False), (1, False)]
)
def test_temperatures_below_eps_are_greedy(temperature, greedy):
    assert SamplingParams(temperature=temperature).greedy is greedy


def test_max_tokens_none_means_up_to_the_context():
    assert SamplingParams(max_tokens=None).max_tokens is None
    assert SamplingParams(max_tokens=1).max_tokens == 1


def test_n_and_output_kind():
    p = SamplingParams()
    assert p.n == 1 and p.output_kind is RequestOutputKind.CUMULATIVE
    p = SamplingParams(n=256, output_kind=RequestOutputKind.DELTA)
    assert p.n == 256 and p.output_kind is RequestOutputKind.DELTA
    assert {k.name for k in RequestOutputKind} == {"CUMULATIVE", "DELTA", "FINAL_ONLY"}


@pytest.mark.parametrize(
    ("ids", "why"),
    [
        (5, "must be a list of token ids, not an int"),
        ("12", "must be a list of token ids, not a str"),
        ([1, True], "token id True at index 1 is a bool, not an int"),
        ([1, 2.5, 3], "token id 2.5 at index 1 is a float, not an int"),
        ([None], "token id None at index 0 is None, not an int"),
        ([[1, 2]], r"token id \[1, 2\] at index 0 is a list, not an int"),
        ([3, -1], r"token id -1 at index 1 is outside the vocabulary \[0, 10\)"),
        ((10,), r"token id 10 at index 0 is outside the vocabulary \[0, 10\)"),
        ([2**80], r"token id 1208925819614629174706176 at index 0 is outside"),
    ],
)
def test_token_ids_are_ints_in_the_vocabulary(ids, why):
    with pytest.raises(ValueError, match=rf"^stop_token_ids:? {why}"):
        check_token_ids("stop_token_ids", ids, 10)


def test_token_ids_that_are_fine():
    check_token_ids("prompt", [0, 9], 10)
    check_token_ids("prompt", (3,), 10)
    check_token_ids("prompt", [], 10)  # the engine says an empty prompt is empty
