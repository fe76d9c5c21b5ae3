"""Token ids to text and outputs: stop strings held back then cut, EOS and stop tokens,
lengths, and the three output kinds."""

import pytest
import tokenizers

from tinyllm.engine.output_processor import OutputProcessor, TokenUpdate
from tinyllm.engine.request import Request
from tinyllm.engine.sampling_params import RequestOutputKind, SamplingParams
from tinyllm.text.tokenizer import Tokenizer

LETTERS = ["<eos>", "a", "b", "S", "T", "O", "P", "x"]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    vocab = {t: i for i, t in enumerate(LETTERS)}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="x"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    backend.decoder = tokenizers.decoders.Fuse()
    return Tokenizer(backend, bos_token_id=None, eos_token_ids=[0])


def _feed(tok, text: str, **kw):
    """Feed the letters of `text` one token at a time; every output, and where it stopped."""
    proc = OutputProcessor(tok)
    proc.add_request("r", None, [1, 7], SamplingParams(**kw))
    outputs, stopped_at = [], None
    for i, t in enumerate(text):
        outs, stopped = proc.process([TokenUpdate("r", LETTERS.index(t), None, None)])
        outputs += outs
        if stopped:
            stopped_at = i
            break
    return outputs, stopped_at


def test_stop_string_is_held_back_then_cut(tok):
    outputs, stopped_at = _feed(tok, "aSTbSTOPa", stop=["STOP"], max_tokens=20)
    # "ST" could start "STOP", so it stays hidden until "b" rules that out.
    assert [o.text for o in outputs][:4] == ["a", "a", "a", "aSTb"]
    final = outputs[-1]
    assert stopped_at == 7 and final.finished
    assert final.finish_reason == "stop" and final.outputs[0].stop_reason == "STOP"
    assert final.text == "aSTb" and len(final.token_ids) == 8


def test_delta_outputs_add_up_to_the_cumulative_ones(tok):
    cumulative, _ = _feed(tok, "abSTObSTOP", stop=["STOP"])
    delta, _ = _feed(tok, "abSTObSTOP", stop=["STOP"], output_kind=RequestOutputKind.DELTA)
    assert len(delta) == len(cumulative)
    for i, out in enumerate(cumulative):  # each delta is exactly what is new
        assert "".join(d.text for d in delta[: i + 1]) == out.text
        assert sum((d.token_ids for d in delta[: i + 1]), []) == out.token_ids
    assert max(len(d.token_ids) for d in delta) == 1
    final_only, _ = _feed(
        tok, "abSTObSTOP", stop=["STOP"], output_kind=RequestOutputKind.FINAL_ONLY
    )
    assert len(final_only) == 1 and final_only[0].text == cumulative[-1].text == "abSTOb"


def _request(**kw) -> Request:
    params = SamplingParams(**kw)
    return Request("r", [1, 7], params, params.max_tokens, [0], seed=0)


def test_eos_stop_token_and_length():
    r = _request(max_tokens=5)
    r.append_token(1, max_model_len=64)
    r.append_token(0, max_model_len=64)
    assert r.finish_reason == "stop" and r.stop_reason == 0
    r = _request(max_tokens=5, ignore_eos=True, stop_token_ids=[7])
    r.append_token(0, max_model_len=64)
    assert r.finish_reason is None
    r.append_token(7, max_model_len=64)
    assert r.finish_reason == "stop" and r.stop_reason == 7
    r = _request(max_tokens=2, ignore_eos=True)
    r.append_token(0, max_model_len=64)
    r.append_token(0, max_model_len=64)
    assert r.finish_reason == "length"
    r = _request(max_tokens=50, ignore_eos=True)  # the context ends it first
    r.append_token(3, max_model_len=4)
    assert r.finish_reason is None
    r.append_token(3, max_model_len=4)
    assert r.finish_reason == "length" and r.num_tokens == 4
