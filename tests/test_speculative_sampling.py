"""Speculative decoding's verification (Sampler.verify), its settings and its auto-off rules,
without a model: the sampled tokens follow the target distribution whatever the drafts are."""

import random

import pytest
import torch

from tinyllm.engine.config import EngineConfig, SpeculativeConfig
from tinyllm.engine.sampling_params import SamplingParams
from tinyllm.engine.sched.request import Request
from tinyllm.engine.spec_decode.ngram_proposer import NgramProposer
from tinyllm.engine.spec_decode.speculator import Speculator
from tinyllm.engine.worker.model_runner import CachedRequestState
from tinyllm.engine.worker.sampler import Sampler, _accept_or_resample, _probs

V = 6
# The false-alarm rate of each chi-square check below (with fixed seeds the test is
# deterministic; this is how unlikely a correct sampler is to fail it).
ALPHA = 1e-4


def _request(params: SamplingParams, prompt: list[int]) -> Request:
    return Request("r", prompt, params, max_tokens=100, eos_token_ids=[0], seed=0)


def _sampled(params: SamplingParams, seed: int = 0) -> CachedRequestState:
    """A request as the sampler sees it: the model runner's state of it."""
    prompt = [5, 6, 7]
    generator = torch.Generator().manual_seed(seed)
    return CachedRequestState("r", len(prompt), params, generator, prompt, [])


def _target(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    return _probs(logits, [params] * len(logits)).double()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=4),
        SamplingParams(temperature=1.3, top_p=0.8),
    ],
    ids=["plain", "top_k", "top_p"],
)
def test_sampled_tokens_follow_the_target_whatever_the_drafts(params):
    """The speculative sampling rule (`_accept_or_resample`, which Sampler.verify applies to
    each sampled row with drafts). Rows 0..2 predict positions 1..3. With drafts [a, b],
    position 1's token is distributed as row 0's p whatever a is (likely or not); given that it
    was a, position 2's as row 1's; given a then b, position 3's as row 2's. 2500 draws each,
    one generator."""
    torch.manual_seed(1)
    logits = torch.randn(3, V) * 1.5
    target = _target(logits, params)
    likely, unlikely = int(target[0].argmax()), int(target[0].argmin())
    req = _sampled(params, seed=7)
    for first in (likely, unlikely):
        draft = [first, int(target[1].argmax())]
        runs = [_accept_or_resample(logits, draft, req) for _ in range(2500)]
        _check(target[0], [run[0] for run in runs])
        _check(target[1], [run[1] for run in runs if run[0] == first])
        _check(target[2], [run[2] for run in runs if run[:2] == draft])


def _check(p: torch.Tensor, tokens: list[int]) -> None:
    if len(tokens) < 300:  # too few to tell (a draft the target rarely or never picks)
        return
    counts = torch.bincount(torch.tensor(tokens), minlength=V).double()
    expected = p * len(tokens)
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token outside the target's support was drawn"
    # Categories expected fewer than 5 times are pooled, as the test requires.
    small = keep & (expected < 5)
    obs = [*counts[keep & ~small].tolist(), float(counts[small].sum())]
    exp = [*expected[keep & ~small].tolist(), float(expected[small].sum())]
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    assert _chi_square_pvalue(obs, exp) > ALPHA, (obs, exp)


def _chi_square_pvalue(observed: list[float], expected: list[float]) -> float:
    """Pearson's test: the chance of a statistic this large from the expected distribution,
    the chi-square survival function with k - 1 degrees of freedom: Q((k - 1) / 2, stat / 2)."""
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected, strict=True))
    dof = torch.tensor((len(observed) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, torch.tensor(stat / 2, dtype=torch.float64)))


def test_greedy_accepts_the_argmax_run_and_adds_the_models_token():
    logits = torch.tensor([[0, 3, 1, 0.0], [0, 0, 0, 5.0], [2, 0, 0, 0.0], [0, 0, 9, 0.0]])
    greedy = _sampled(SamplingParams(temperature=0, logprobs=1))
    (tokens,), (logprobs,) = Sampler().verify(logits, [greedy], [[1, 3, 1]])
    # 1 and 3 are row 0's and row 1's argmax; row 2's is 0, not the draft 1.
    assert tokens == [1, 3, 0]
    assert [lp.token_id for lp in logprobs] == tokens
    assert logprobs[2].logprob == pytest.approx(float(logits[2].log_softmax(-1)[0]))
    (all_ok,), _ = Sampler().verify(logits, [greedy], [[1, 3, 0]])
    assert all_ok == [1, 3, 0, 2]  # every draft accepted: the last row's token is added


def test_a_request_without_drafts_draws_as_without_speculation():
    """Same seed, same logits: a request without drafts draws as it does alone, draw for draw,
    next to a row that has drafts."""
    torch.manual_seed(0)
    logits = torch.randn(4, V)
    sampled = SamplingParams(temperature=1.0, seed=3)
    ((plain,),), _ = Sampler().verify(logits[:1], [_sampled(sampled)], [[]])
    a, other = _sampled(sampled), _sampled(SamplingParams(temperature=0))
    tokens, _ = Sampler().verify(logits, [a, other], [[], [1, 2]])
    assert tokens[0] == [plain]


def _decoding(prompt: list[int], params: SamplingParams, output: list[int]) -> Request:
    r = _request(params, prompt)
    r.all_token_ids += output
    r.num_computed_tokens = r.num_tokens - 1
    return r


def test_drafts_come_from_the_context_and_stop_at_max_tokens():
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=4), max_model_len=100)
    params = SamplingParams(temperature=0, max_tokens=100)
    r = _decoding([1, 2, 3, 4, 5, 6, 7, 8, 1, 2], params, [3])
    spec.propose([r])
    assert r.spec_token_ids == [4, 5, 6, 7]
    r.max_tokens = 3  # two more tokens may come: one draft and the model's own
    spec.propose([r])
    assert r.spec_token_ids == [4]


def _matching(n: int) -> list[int]:
    """A context whose longest earlier match is its last n tokens, followed by 20 tokens."""
    match = list(range(1, n + 1))
    return [50, *match, *range(100, 120), 60, *match]


@pytest.mark.parametrize(("cap", "counts"), [(6, [1, 2, 4, 6, 6]), (16, [1, 2, 4, 8, 16])])
def test_the_longer_the_match_the_more_drafts_up_to_num_speculative_tokens(cap, counts):
    """2^(n - 1) drafts from a match of n tokens (a 1-token match is often chance, a 5-token one
    nearly always a copy), never more than num_speculative_tokens or the room left; a request
    whose drafts were all rejected drafts again as its next match says (no back-off)."""
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=cap), max_model_len=1000)
    greedy = SamplingParams(temperature=0)
    for n, count in zip(range(1, 6), counts, strict=True):
        context = _matching(n)
        r = _decoding(context[:-1], greedy, context[-1:])
        spec.propose([r])
        assert r.spec_token_ids == list(range(100, 100 + count)), n
        spec.record(count, 0)
        spec.propose([r])
        assert len(r.spec_token_ids) == count, n
        r.max_tokens = r.num_output_tokens + 3  # room for two drafts and the model's token
        spec.propose([r])
        assert len(r.spec_token_ids) == min(count, 2), n
    sampled = SamplingParams(temperature=0.8)
    for n, count in [(1, 0), (2, 2), (3, 4)]:  # from 2 tokens on, as greedy requests
        context = _matching(n)
        r = _decoding(context[:-1], sampled, context[-1:])
        spec.propose([r])
        assert len(r.spec_token_ids) == count, n


def test_a_sampled_request_drafts_only_from_a_match_of_two_tokens():
    """Random text matches single tokens by chance, and a sampled draft is accepted only with
    its probability: a 1-token match drafts for a greedy request, not for a sampled one; a
    2-token match drafts for both. Unless prompt_lookup_max allows only 1-token matches."""
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=3), max_model_len=100)
    one, two = [9, 1, 7, 8, 4, 5, 1], [9, 4, 1, 7, 8, 6, 4, 1]  # ... 1 | ... 4, 1
    sampled, greedy = SamplingParams(temperature=0.8), SamplingParams(temperature=0)
    for params, context, drafts in [
        (greedy, one, [7]),
        (sampled, one, []),
        (greedy, two, [7, 8]),
        (sampled, two, [7, 8]),
    ]:
        r = _decoding(context[:-1], params, context[-1:])
        spec.propose([r])
        assert r.spec_token_ids == drafts, (params.temperature, context)
    only_one = Speculator(SpeculativeConfig(prompt_lookup_max=1), max_model_len=100)
    r = _decoding(one[:-1], sampled, one[-1:])
    only_one.propose([r])
    assert r.spec_token_ids == [7]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_drafts_follow_a_request_as_its_tokens_grow_through_skipped_steps_and_preemption(
    temperature,
):
    """The request keeps its n-gram index between steps: whatever steps it skips (crowded, or
    preempted and recomputing), its drafts are what a search of all its tokens finds."""
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=3), max_model_len=1000)
    fresh = NgramProposer(3, 1 if temperature == 0 else 2, 5)

    def searched(tokens: list[int]) -> list[int]:
        match = fresh.match(tokens)
        return [] if match is None else match.drafts(tokens, min(3, 2 ** (match.length - 1)))

    rng = random.Random(0)
    params = SamplingParams(temperature=temperature)
    r = _decoding([rng.randrange(4) for _ in range(20)], params, [rng.randrange(4)])
    r.max_tokens = 900  # room for every draft: only the index decides them
    drafted = 0
    for _ in range(150):
        r.all_token_ids += [rng.randrange(4) for _ in range(rng.randint(1, 4))]
        preempted, crowded = rng.random() < 0.2, rng.random() < 0.2
        # Preempted: recomputing its tokens, so not decoding and not asked for drafts.
        r.num_computed_tokens = 0 if preempted else r.num_tokens - 1
        r.spec_token_ids = []
        spec.propose([r] * 5 if crowded else [r])  # 5 decoding rows > max_batch
        if preempted or crowded:
            assert r.spec_token_ids == []
        else:
            assert r.spec_token_ids == searched(list(r.all_token_ids)), r.num_tokens
        drafted += len(r.spec_token_ids)
    assert drafted > 100  # the comparison saw drafts, not only empty steps


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(repetition_penalty=1.2),
        SamplingParams(presence_penalty=0.5),
        SamplingParams(frequency_penalty=0.5),
    ],
)
def test_penalized_requests_are_not_speculated(params):
    spec = Speculator(SpeculativeConfig(), max_model_len=100)
    r = _decoding([1, 2, 3, 4, 1, 2], params, [3])
    spec.propose([r])
    assert r.spec_token_ids == []


def test_a_crowded_step_and_a_missing_request_get_no_drafts():
    spec = Speculator(SpeculativeConfig(max_batch=2), max_model_len=100)
    params = SamplingParams(temperature=0)
    rows = [_decoding([1, 2, 3, 1, 2], params, [3]) for _ in range(3)]
    spec.propose(rows)
    assert all(r.spec_token_ids == [] for r in rows)  # 3 decoding rows > max_batch
    spec.propose(rows[:2])
    assert all(r.spec_token_ids == [1, 2, 3] for r in rows[:2])
    for drafted, accepted in [(3, 0), (3, 2), (1, 1)]:
        spec.record(drafted, accepted)
    assert spec.stats.num_drafts == 3 and spec.stats.num_draft_tokens == 7
    assert spec.stats.mean_acceptance_length == pytest.approx(1 + 3 / 3)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"method": "eagle"}, "method='eagle': tinyllm has 'ngram'"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens=0 must be an integer >= 1"),
        ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_max=2 must be an"),
        ({"lookahead": 3}, r"unknown key\(s\) \['lookahead'\]"),
        ("{not json", "speculative_config is not valid JSON"),
        (5, "speculative_config must be a dict"),
    ],
)
def test_bad_settings_are_named(value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config=value)


def test_settings_from_json_text():
    cfg = EngineConfig(speculative_config='{"num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert cfg.speculative_config == SpeculativeConfig(
        num_speculative_tokens=3, prompt_lookup_max=4
    )
