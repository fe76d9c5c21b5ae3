"""The default model against Hugging Face transformers on the same GGUF: last-position logits
and the first 32 greedy tokens, for chat and raw prompts of 1 to ~500 tokens run as one batch."""

import pytest
import torch

from tests.greedy import assert_greedy_close, top_dicts
from tests.model_runs import prompt_logits
from tinyllm.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

# fp32 on both sides with identical dequantized weights; what differs is summation order
# (SDPA vs eager attention, fused vs unfused matmuls) through 30 layers. Logits here are O(10-30)
# and the observed worst difference is 5e-5, so 2e-3 leaves headroom while a real bug (a wrong
# RoPE position, a mask leak, a missing norm) moves logits by whole units.
LOGIT_ATOL = 2e-3
N_TOKENS = 32

PARAGRAPH = (
    "The history of the printing press begins in the fifteenth century, when movable type "
    "changed how knowledge travelled across Europe. Workshops multiplied, prices fell, and "
    "ideas that once took decades to spread could reach a continent in a few years. "
)


@pytest.fixture(scope="module")
def hf_model(default_gguf_path):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(
        default_gguf_path.parent, gguf_file=default_gguf_path.name, dtype=torch.float32
    )
    return m.eval()


@pytest.fixture(scope="module")
def prompts(default_llm):
    tok = default_llm.tokenizer

    def chat(text: str) -> list[int]:
        rendered = tok.apply_chat_template([{"role": "user", "content": text}])
        return tok.encode(rendered, add_special_tokens=False)

    out = [
        tok.encode("Paris"),  # one token
        tok.encode("The capital of France is"),
        tok.encode("def fibonacci(n):\n    "),
        tok.encode("Un café, s'il vous plaît. 東京は日本の首都です。 🙂"),
        chat("What is the capital of France?"),
        chat("Write a short poem about autumn leaves."),
        tok.encode(PARAGRAPH * 4 + "In summary,"),
        chat(PARAGRAPH * 10 + "Summarise the text above in one sentence."),
    ]
    assert len(out[0]) == 1 and 450 < len(out[-1]) < 600
    return out


def _hf_greedy(model, ids: list[int]) -> tuple[list[int], list[dict[int, float]], torch.Tensor]:
    """Greedy decoding with the reference, never stopping at EOS (like ignore_eos)."""
    with torch.inference_mode():
        out = model(torch.tensor([ids]), use_cache=True)
        first_logits = out.logits[0, -1]
        tokens, tops = [], []
        logits, past = first_logits, out.past_key_values
        for _ in range(N_TOKENS):
            lp = logits.float().log_softmax(-1)
            top = lp.topk(5)
            tok = int(lp.argmax())
            tokens.append(tok)
            tops.append(dict(zip(top.indices.tolist(), top.values.tolist(), strict=True)))
            out = model(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
            logits, past = out.logits[0, -1], out.past_key_values
    return tokens, tops, first_logits


@pytest.fixture(scope="module")
def reference(hf_model, prompts):
    return [_hf_greedy(hf_model, p) for p in prompts]


def test_last_position_logits_match_in_one_flat_batch(default_llm, prompts, reference):
    logits = prompt_logits(default_llm.engine.model, prompts, block_size=16)
    for i, (_, _, ref_logits) in enumerate(reference):
        torch.testing.assert_close(
            logits[i][-1],
            ref_logits,
            atol=LOGIT_ATOL,
            rtol=0,
            msg=lambda m, i=i: f"prompt {i}: {m}",
        )


def test_greedy_tokens_match(default_llm, prompts, reference):
    params = SamplingParams(max_tokens=N_TOKENS, temperature=0, ignore_eos=True, logprobs=5)
    outs = default_llm.generate(prompts, params, use_tqdm=False)
    for i, (out, (ref_ids, ref_tops, _)) in enumerate(zip(outs, reference, strict=True)):
        assert len(out.token_ids) == N_TOKENS
        assert_greedy_close(
            ref_ids, ref_tops, out.token_ids, top_dicts(out.outputs[0].logprobs), f"prompt {i}"
        )


def test_answer_says_paris(default_llm):
    out = default_llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(max_tokens=24, temperature=0),
        use_tqdm=False,
    )[0]
    assert "Paris" in out.text and out.finish_reason == "stop"


def test_prompt_logprobs_match(default_llm, hf_model, prompts):
    """Every prompt position's logprobs against the reference's log-softmax over the whole
    prompt: the chosen (prompt) token's and the top 5, including a prompt chunked by the budget
    (the ~500-token chat prompt) and batched with the others."""
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=5)
    outs = default_llm.generate(prompts[1:], params, use_tqdm=False)
    for ids, out in zip(prompts[1:], outs, strict=True):
        with torch.inference_mode():
            ref = hf_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        got = out.prompt_logprobs
        assert got[0] is None and len(got) == len(ids)
        chosen = torch.tensor([lp.logprob for lp in got[1:]])
        want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        torch.testing.assert_close(chosen, want, atol=LOGIT_ATOL, rtol=0)
        top = torch.tensor([[v for _, v in lp.top] for lp in got[1:]])
        torch.testing.assert_close(top, ref[:-1].topk(5).values, atol=LOGIT_ATOL, rtol=0)
