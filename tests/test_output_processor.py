"""Token ids to text and outputs: stop strings held back then cut, EOS and stop tokens,
lengths, and the three output kinds."""

import pytest
import tokenizers

from tinyllm.engine.output_processor import OutputProcessor, TokenUpdate
from tinyllm.engine.outputs import TokenLogprob
from tinyllm.engine.sampling_params import RequestOutputKind, SamplingParams
from tinyllm.engine.sched.request import Request
from tinyllm.text.tokenizer import Tokenizer

LETTERS = ["<eos>", "a", "b", "S", "T", "O", "P", "x", "bS"]  # "bS": one token, two letters


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    vocab = {t: i for i, t in enumerate(LETTERS)}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="x"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    backend.decoder = tokenizers.decoders.Fuse()
    return Tokenizer(backend, bos_token_id=None, eos_token_ids=[0])


def _feed(tok, tokens: str | list[str], **kw):
    """Feed `tokens` (each letter of a str) one at a time; every output, and where it stopped.
    With logprobs asked for, the i-th token's logprob is -i."""
    proc = OutputProcessor(tok)
    proc.add_request("r", None, [1, 7], SamplingParams(**kw))
    outputs, stopped_at = [], None
    for i, t in enumerate(tokens):
        token = LETTERS.index(t)
        logprob = TokenLogprob(token, -i) if kw.get("logprobs") is not None else None
        outs, stopped = proc.process([TokenUpdate("r", [token], [logprob], None)])
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
    assert final.text == "aSTb" and _letters(final.token_ids) == "aSTb"


def test_several_tokens_in_one_update_end_where_one_at_a_time_do(tok):
    """Speculative decoding hands over a run of accepted tokens at once: a stop string inside
    the run ends the output exactly where feeding them one by one would, the rest dropped."""
    text, kw = "abSTOPba", dict(stop=["STOP"], logprobs=0)
    one_by_one, _ = _feed(tok, text, **kw)
    proc = OutputProcessor(tok)
    proc.add_request("r", None, [1, 7], SamplingParams(**kw))
    tokens = [LETTERS.index(t) for t in text]
    logprobs = [TokenLogprob(t, -i) for i, t in enumerate(tokens)]
    outs, stopped = proc.process([TokenUpdate("r", tokens[:3], logprobs[:3], None)])
    outs2, stopped2 = proc.process([TokenUpdate("r", tokens[3:], logprobs[3:], None)])
    assert not stopped and stopped2 == ["r"]
    final, expected = outs2[-1], one_by_one[-1]
    assert final.finished and final.finish_reason == "stop"
    assert final.text == expected.text == "ab"
    assert final.token_ids == expected.token_ids
    assert final.outputs[0].logprobs == expected.outputs[0].logprobs


def test_delta_outputs_add_up_to_the_cumulative_ones(tok):
    cumulative, _ = _feed(tok, "abSTObSTOP", stop=["STOP"])
    delta, _ = _feed(tok, "abSTObSTOP", stop=["STOP"], output_kind=RequestOutputKind.DELTA)
    assert len(delta) == len(cumulative)
    for i, out in enumerate(cumulative):  # each delta is exactly what is new
        assert "".join(d.text for d in delta[: i + 1]) == out.text
        assert sum((d.token_ids for d in delta[: i + 1]), []) == out.token_ids
    # A token goes out with its text: "STO" waits with its tokens until "b" rules "STOP" out.
    assert [_letters(d.token_ids) for d in delta] == [d.text for d in delta]
    assert [d.text for d in delta] == ["a", "b", "", "", "", "STOb", "", "", "", ""]
    final_only, _ = _feed(
        tok, "abSTObSTOP", stop=["STOP"], output_kind=RequestOutputKind.FINAL_ONLY
    )
    assert len(final_only) == 1 and final_only[0].text == cumulative[-1].text == "abSTOb"


def _letters(token_ids: list[int]) -> str:
    return "".join(LETTERS[t] for t in token_ids)


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_a_stop_strings_tokens_and_logprobs_go_with_its_text(tok, kind):
    """Tokens wholly past the cut are not reported, nor their logprobs; the last "bS" starts
    before it, in the text, so it stays (the completions API's text_offset stays in the text)."""
    tokens = ["a", "bS", "T", "x", "bS", "T", "O", "P"]
    outputs, stopped_at = _feed(tok, tokens, stop=["STOP"], logprobs=0, output_kind=kind)
    assert stopped_at == 7
    completions = [o.outputs[0] for o in outputs]
    if kind is not RequestOutputKind.DELTA:  # what a client has: the last output, or the sum
        completions = completions[-1:]
    assert "".join(c.text for c in completions) == "abSTxb"
    assert _letters(sum((c.token_ids for c in completions), [])) == "abSTxbS"
    logprobs = sum((c.logprobs for c in completions), [])
    assert [(lp.token_id, lp.logprob) for lp in logprobs] == [
        (LETTERS.index(t), -i) for i, t in enumerate(tokens[:5])
    ]


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
