"""SamplingParams validation, the sampler's filters and penalties, and stop handling."""

import pytest
import tokenizers
import torch

from tinyllm.engine.sampler import sample
from tinyllm.engine.sampling_params import SamplingParams
from tinyllm.engine.sequence import Sequence
from tinyllm.text.tokenizer import Tokenizer

LETTERS = ["<eos>", "a", "b", "S", "T", "O", "P", "x"]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    vocab = {t: i for i, t in enumerate(LETTERS)}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="x"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    backend.decoder = tokenizers.decoders.Fuse()
    return Tokenizer(backend, bos_token_id=None, eos_token_ids=[0])


def _seq(tok, **kw) -> Sequence:
    return Sequence("r", None, [1, 7], SamplingParams(**kw), tok, max_model_len=64, seed=0)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("temperature", -0.5),
        ("top_p", 0.0),
        ("top_k", -2),
        ("min_p", 1.5),
        ("repetition_penalty", 0.0),
        ("presence_penalty", 3.0),
        ("logprobs", 21),
        ("stop", [""]),
        ("seed", 2**64),
    ],
)
def test_invalid_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}=.* must"):
        SamplingParams(**{field: value})


def test_stop_string_is_held_back_then_cut(tok):
    seq = _seq(tok, stop=["STOP"], max_tokens=20)
    shown = []
    for t in "aSTbSTOPa":
        seq.append(LETTERS.index(t), None)
        shown.append(seq.visible_text())
        if seq.finished:
            break
    # "ST" could start "STOP", so it stays hidden until "b" rules that out.
    assert shown[:4] == ["a", "a", "a", "aSTb"]
    assert seq.finished and seq.finish_reason == "stop" and seq.stop_reason == "STOP"
    assert seq.visible_text() == "aSTb" and len(seq.output_token_ids) == 8


def test_eos_stop_token_and_length(tok):
    seq = _seq(tok, max_tokens=5)
    seq.append(1, None)
    seq.append(0, None)
    assert seq.finish_reason == "stop" and seq.stop_reason == 0 and seq.visible_text() == "a"
    seq = _seq(tok, max_tokens=5, ignore_eos=True, stop_token_ids=[7])
    seq.append(0, None)
    assert not seq.finished
    seq.append(7, None)
    assert seq.finish_reason == "stop" and seq.stop_reason == 7
    seq = _seq(tok, max_tokens=2, ignore_eos=True)
    seq.append(0, None)
    seq.append(0, None)
    assert seq.finish_reason == "length"


def test_greedy_penalties_and_bias(tok):
    logits = torch.tensor([[0.0, 3.0, 2.9, 1.0, 0, 0, 0, 0]] * 4)
    seqs = [
        _seq(tok, temperature=0),
        _seq(tok, temperature=0, repetition_penalty=1.5),  # token 1 is in the prompt: 3.0/1.5
        _seq(tok, temperature=0, logit_bias={3: 5.0}),
        _seq(tok, temperature=0, logprobs=2),
    ]
    tokens, lps = sample(logits, seqs)
    assert tokens == [1, 2, 3, 1]
    assert lps[:3] == [None] * 3
    ref = logits[3].log_softmax(-1)
    assert lps[3].token_id == 1 and lps[3].logprob == pytest.approx(ref[1].item())
    assert [t for t, _ in lps[3].top] == [1, 2]


def test_frequency_and_presence_penalties(tok):
    seq = _seq(tok, temperature=0, frequency_penalty=1.0)
    seq.output_token_ids = [1, 1]
    assert sample(torch.tensor([[0, 3.0, 1.5, 0, 0, 0, 0, 0]]), [seq])[0] == [2]  # 3 - 2 < 1.5
    seq = _seq(tok, temperature=0, presence_penalty=1.0)
    seq.output_token_ids = [1, 1]
    assert sample(torch.tensor([[0, 3.0, 1.5, 0, 0, 0, 0, 0]]), [seq])[0] == [1]  # 3 - 1 > 1.5


def test_top_k_top_p_min_p_restrict_the_draws(tok):
    logits = torch.tensor([[0.0, 2.0, 1.9, 1.8, -1, -1, -1, -1]])
    cases = [
        ({"top_k": 2}, {1, 2}),
        ({"top_p": 0.5}, {1, 2}),
        ({"min_p": 0.8}, {1, 2, 3}),
        ({"top_k": 1}, {1}),
    ]
    for kw, allowed in cases:
        seq = _seq(tok, temperature=1.0, seed=3, **kw)
        drawn = {sample(logits, [seq])[0][0] for _ in range(200)}
        assert drawn == allowed, kw


def test_seeded_draws_do_not_depend_on_batch_neighbours(tok):
    logits = torch.randn(1, 8)
    alone = _seq(tok, temperature=1.0, seed=42)
    in_batch = _seq(tok, temperature=1.0, seed=42)
    others = [_seq(tok, temperature=0.7) for _ in range(3)]
    a = [sample(logits, [alone])[0][0] for _ in range(30)]
    b = [
        sample(torch.cat([logits] * 4), [others[0], in_batch, *others[1:]])[0][1] for _ in range(30)
    ]
    assert a == b and len(set(a)) > 1
