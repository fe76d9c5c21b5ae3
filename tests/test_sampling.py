"""The sampler: penalties, filters and seeded draws over a batch, checked against a plain
per-row reference."""

from types import SimpleNamespace

import pytest
import torch

from tinyllm.engine.sampling_params import SamplingParams
from tinyllm.engine.worker.sampler import Sampler, apply_penalties

_sampler = Sampler()


def sample(logits: torch.Tensor, requests: list) -> tuple[list[int], list]:
    """Each request's token and its logprob, as the model runner samples a step without drafts
    (Sampler.verify)."""
    tokens, logprobs = _sampler.verify(logits, requests, [[] for _ in requests])
    return [t for (t,) in tokens], [lp for (lp,) in logprobs]


def _req(prompt=(1, 7), output=(), **kw) -> SimpleNamespace:
    """What the engine's Request gives the sampler, with a generator seeded like the engine's."""
    params = SamplingParams(**kw)
    return SimpleNamespace(
        params=params,
        generator=torch.Generator().manual_seed(params.seed or 0),
        prompt_token_ids=list(prompt),
        output_token_ids=list(output),
    )


def _ref_penalize(row: torch.Tensor, req) -> torch.Tensor:
    """vLLM's penalties for one row, token by token."""
    x, p, out = row.clone(), req.params, req.output_token_ids
    for t in set(req.prompt_token_ids + out):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(out):
        x[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
    for t, b in p.logit_bias.items():
        x[t] += b
    return x


def _ref_token(row: torch.Tensor, req) -> int:
    """One row's token: penalties, then greedy, or temperature, min-p, top-k, top-p and the
    exponential race with the request's own generator."""
    x, p = _ref_penalize(row, req), req.params
    if p.greedy:
        return int(x.argmax())
    x = x / p.temperature
    probs = x.softmax(-1)
    ranked = [t for t in x.argsort(descending=True).tolist() if probs[t] >= p.min_p * probs.max()]
    ranked = ranked[: p.top_k or None]
    kept, mass = [], 0.0
    for t, q in zip(ranked, x[ranked].softmax(-1).tolist(), strict=True):
        if mass >= p.top_p:
            break
        kept.append(t)
        mass += q
    probs = torch.full_like(x, float("-inf")).index_copy_(0, torch.tensor(kept), x[kept])
    noise = torch.empty(len(x)).exponential_(generator=req.generator)
    return int((probs.softmax(-1) / noise).argmax())


def _mixed_batch() -> list[SimpleNamespace]:
    """One row per code path; token lists with repeats so that counts matter."""
    g = torch.Generator().manual_seed(1)
    kws = [
        {"temperature": 0},
        {"temperature": 0, "repetition_penalty": 1.3},
        {"temperature": 0, "frequency_penalty": 0.5, "presence_penalty": 0.3, "logprobs": 3},
        {"temperature": 0, "logit_bias": {5: 10.0, 6: -3.0}},
        {"temperature": 1e-38},
        {"temperature": 0.8, "top_k": 5, "seed": 1},
        {"top_p": 0.7, "seed": 2},
        {"min_p": 0.1, "seed": 3},
        {"top_k": 10, "top_p": 0.9, "min_p": 0.05, "repetition_penalty": 0.8, "seed": 4},
        {"temperature": 1.5, "logprobs": 0, "logit_bias": {3: 2.0}, "seed": 5},
        {"presence_penalty": -1.0, "frequency_penalty": 2.0, "top_k": 3, "seed": 6},
        {"temperature": 0, "frequency_penalty": 1.0},  # nothing generated yet: no penalty
    ]
    reqs = []
    for r, kw in enumerate(kws):
        prompt = torch.randint(0, 64, (8,), generator=g).tolist()
        output = torch.randint(0, 16, (6,), generator=g).tolist() if r < len(kws) - 1 else []
        reqs.append(_req(prompt, output, **kw))
    return reqs


def test_batched_penalties_match_the_per_row_reference():
    reqs = _mixed_batch()
    logits = torch.randn(len(reqs), 64, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    got = apply_penalties(logits, reqs)
    want = torch.stack([_ref_penalize(row, req) for row, req in zip(logits, reqs, strict=True)])
    torch.testing.assert_close(got, want)
    assert torch.equal(logits, before)  # the caller's logits stay raw, for logprobs


def test_mixed_batch_matches_the_per_row_reference_step_after_step():
    batch, alone = _mixed_batch(), _mixed_batch()  # same seeds, so the same generators
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = torch.randn(len(batch), 64, generator=g) * 3
        tokens, lps = sample(logits, batch)
        assert tokens == [_ref_token(row, req) for row, req in zip(logits, alone, strict=True)]
        for tok, lp, row, req in zip(tokens, lps, logits, batch, strict=True):
            n = req.params.logprobs
            if n is None:
                assert lp is None
                continue
            raw = row.log_softmax(-1)  # the model's distribution, before any penalty
            assert lp.token_id == tok and lp.logprob == pytest.approx(raw[tok].item())
            top = raw.topk(n)
            assert [t for t, _ in lp.top] == top.indices.tolist()
            assert [v for _, v in lp.top] == pytest.approx(top.values.tolist())
        for req, other, tok in zip(batch, alone, tokens, strict=True):
            req.output_token_ids.append(tok)
            other.output_token_ids.append(tok)


def test_plain_greedy_batch_is_just_an_argmax():
    # No token lists and no generators: the hot path must not touch them.
    reqs = [
        SimpleNamespace(
            params=SamplingParams(temperature=0),
            generator=None,
            prompt_token_ids=None,
            output_token_ids=None,
        )
        for _ in range(3)
    ]
    logits = torch.randn(3, 50)
    assert apply_penalties(logits, reqs) is logits
    assert sample(logits, reqs) == (logits.argmax(-1).tolist(), [None] * 3)


@pytest.mark.parametrize("s", range(3))
def test_tiny_temperature_takes_the_argmax(s):
    # logits / 1e-38 overflow to +-inf, softmax gives NaNs, and argmax of NaNs is token 0.
    logits = torch.tensor([[0.5, 4.0, 5.0, 0.1, -1, 10.0, 0, 0]])
    assert sample(logits, [_req(temperature=1e-38, seed=s)])[0] == [5]


def test_greedy_penalties_and_bias():
    logits = torch.tensor([[0.0, 3.0, 2.9, 1.0, 0, 0, 0, 0]] * 4)
    reqs = [
        _req(temperature=0),
        _req(temperature=0, repetition_penalty=1.5),  # token 1 is in the prompt: 3.0/1.5
        _req(temperature=0, logit_bias={3: 5.0}),
        _req(temperature=0, logprobs=2),
    ]
    tokens, lps = sample(logits, reqs)
    assert tokens == [1, 2, 3, 1]
    assert lps[:3] == [None] * 3
    ref = logits[3].log_softmax(-1)
    assert lps[3].token_id == 1 and lps[3].logprob == pytest.approx(ref[1].item())
    assert [t for t, _ in lps[3].top] == [1, 2]


def test_logprobs_past_the_vocabulary_list_all_of_it():
    logits = torch.randn(2, 8)
    _, lps = sample(logits, [_req(temperature=0, logprobs=20), _req(temperature=0, logprobs=1)])
    assert [len(lp.top) for lp in lps] == [8, 1]


def test_frequency_and_presence_penalties():
    logits = torch.tensor([[0, 3.0, 1.5, 0, 0, 0, 0, 0]])
    req = _req(output=[1, 1], temperature=0, frequency_penalty=1.0)
    assert sample(logits, [req])[0] == [2]  # 3 - 2 < 1.5
    req = _req(output=[1, 1], temperature=0, presence_penalty=1.0)
    assert sample(logits, [req])[0] == [1]  # 3 - 1 > 1.5


def test_top_k_top_p_min_p_restrict_the_draws():
    logits = torch.tensor([[0.0, 2.0, 1.9, 1.8, -1, -1, -1, -1]])
    probs = torch.tensor([[0.05, 0.5, 0.3, 0.05, 0.05, 0.05]])
    cases = [
        (logits, {"top_k": 2}, {1, 2}),
        (logits, {"top_p": 0.5}, {1, 2}),
        (logits, {"min_p": 0.8}, {1, 2, 3}),
        (logits, {"top_k": 1}, {1}),
        # vLLM's order: top-p over the top-k renormalized (0.625, 0.375), so 0.6 keeps one.
        (probs.log(), {"top_k": 2, "top_p": 0.6}, {1}),
    ]
    for row, kw, allowed in cases:
        req = _req(temperature=1.0, seed=3, **kw)
        drawn = {sample(row, [req])[0][0] for _ in range(200)}
        assert drawn == allowed, kw


def test_seeded_draws_do_not_depend_on_batch_neighbours():
    logits = torch.randn(1, 8)
    alone = _req(temperature=1.0, seed=42)
    in_batch = _req(temperature=1.0, seed=42)
    others = [_req(temperature=0.7) for _ in range(3)]
    a = [sample(logits, [alone])[0][0] for _ in range(30)]
    b = [
        sample(torch.cat([logits] * 4), [others[0], in_batch, *others[1:]])[0][1] for _ in range(30)
    ]
    assert a == b and len(set(a)) > 1
