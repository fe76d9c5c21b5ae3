"""SamplingParams: validation that names the field, greedy, and the vLLM-style fields."""

import pytest

from tinyllm.engine.sampling_params import RequestOutputKind, SamplingParams


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("max_tokens", 2.5),
        ("max_tokens", True),
        ("max_tokens", "3"),
        ("temperature", -0.5),
        ("top_p", 0.0),
        ("top_k", -2),
        ("min_p", 1.5),
        ("repetition_penalty", 0.0),
        ("presence_penalty", 3.0),
        ("logprobs", 21),
        ("stop", [""]),
        ("seed", 2**64),
        ("n", 0),
        ("n", 257),
        ("n", 2.0),
        ("n", True),
        ("output_kind", "delta"),
    ],
)
def test_invalid_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}=.* must"):
        SamplingParams(**{field: value})


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
