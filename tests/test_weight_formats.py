"""The default model in each fast weight format (bf16, int8, int4, int4 with bf16 activations)
against the fp32 dense
reference (the `default_llm` fixture): vLLM's closeness rule on greedy outputs, and perplexity
over a real English text, the Apache License 2.0 as the safetensors package ships it."""

import importlib.metadata
import math

import pytest
import torch

from tests.greedy import assert_greedy_close, top_dicts
from tests.model_runs import prompt_logits
from tinyllm import SamplingParams
from tinyllm.model.quant import QuantLinear

pytestmark = pytest.mark.slow

FORMATS = {
    "bf16": dict(dtype="bfloat16", quantization="none"),
    "int8": dict(quantization="int8", dtype="float32"),
    "int4": dict(quantization="int4", dtype="float32"),
    "int4-bf16": dict(quantization="int4", dtype="bfloat16"),  # auto's choice with AMX
}
RAW = [
    "The capital of France is",
    "def fibonacci(n):",
    "The three primary colours are",
    "Water boils at a temperature of",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Name three colours."}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "How many legs does a spider have?"}],
]
PERPLEXITY_TOKENS = 1024
# Within 1%: bf16; int4 (Q4_1 run as stored; the activations rounded to int8 blocks); int8 (the
# file's 4-bit groups widened to 8 bits, up to the fp16 rounding of each m - d).
PERPLEXITY_TOLERANCE = dict.fromkeys(FORMATS, 0.01)


@pytest.fixture(scope="module", params=list(FORMATS))
def fast_llm(request, default_gguf_path):
    from tinyllm import LLM

    return request.param, LLM(str(default_gguf_path), **FORMATS[request.param], max_model_len=2048)


def test_each_format_runs_its_kernels(fast_llm):
    name, llm = fast_llm
    model = llm.engine.model
    qkv, head = model.model.layers[0].self_attn.qkv_proj, model.lm_head
    if name == "bf16":
        assert isinstance(qkv, torch.nn.Linear) and isinstance(head, torch.nn.Linear)
    else:  # the LM head stays 8-bit in int4 mode
        assert isinstance(qkv, QuantLinear) and qkv.bits == int(name[3])
        assert isinstance(head, QuantLinear) and head.bits == 8
    assert model.dtype == (torch.bfloat16 if "bf16" in name else torch.float32)


def test_greedy_outputs_are_close_to_fp32(default_llm, fast_llm):
    """vLLM's rule: identical up to the first difference; there each side's token is among
    the other's top-5."""
    name, llm = fast_llm
    params = SamplingParams(max_tokens=32, temperature=0, logprobs=5)
    ref = default_llm.generate(RAW, params, use_tqdm=False)
    ref += default_llm.chat(CHATS, params, use_tqdm=False)
    out = llm.generate(RAW, params, use_tqdm=False) + llm.chat(CHATS, params, use_tqdm=False)
    for i, (r, o) in enumerate(zip(ref, out, strict=True)):
        r, o = r.outputs[0], o.outputs[0]
        ref_lps, test_lps = top_dicts(r.logprobs), top_dicts(o.logprobs)
        assert_greedy_close(r.token_ids, ref_lps, o.token_ids, test_lps, f"{name} #{i}", None)


def apache_license() -> str:
    files = importlib.metadata.files("safetensors") or []
    (path,) = [f for f in files if f.name == "LICENSE"]
    text = path.read_text()
    assert "Apache License" in text and "Version 2.0" in text
    return text


def perplexity(llm, ids: list[int]) -> float:
    (logits,) = prompt_logits(llm.engine.model, [ids])
    logprobs = torch.log_softmax(logits[:-1].float(), dim=-1)
    nll = -logprobs.gather(1, torch.tensor(ids[1:])[:, None]).mean()
    return math.exp(nll.item())


def test_perplexity_is_close_to_fp32(default_llm, fast_llm):
    name, llm = fast_llm
    ids = default_llm.tokenizer.encode(apache_license())[:PERPLEXITY_TOKENS]
    assert len(ids) == PERPLEXITY_TOKENS
    ref, got = perplexity(default_llm, ids), perplexity(llm, ids)
    assert 1 < ref < 20  # a real text the model reads well, not noise
    limit = PERPLEXITY_TOLERANCE[name]
    assert abs(got / ref - 1) < limit, f"{name}: perplexity {got:.4f} against fp32 {ref:.4f}"
