"""A decoder layer as C++ ops (the "fused" layer executor: model/decoder_layer.cpp, called by
DecoderLayer.forward) against the model's own modules (the "modules" executor) on the same
kernels, over engine-like steps: prefills, a prompt in two chunks, decodes after them, in each
weight format and dtype and for each family's layer (Qwen2's q/k/v bias, Qwen3's per-head q/k
norms, Mistral's sliding window, Gemma's post-norms, GeGLU and soft-capping). test_hf_loader
compares both paths with transformers on whole prompts; test_layer_executor tests the choice
between them."""

import pytest
import torch

from tinyllm.engine.sampling_params import SamplingParams
from tinyllm.engine.sched.kv_cache_manager import KVCacheManager
from tinyllm.engine.sched.request import Request
from tinyllm.engine.sched.scheduler import step_message
from tinyllm.engine.worker.model_runner import ModelRunner
from tinyllm.model import llama
from tinyllm.model.attention import get_backend
from tinyllm.model.config import ModelConfig
from tinyllm.model.families import build_model
from tinyllm.model.layers import fuse_projections
from tinyllm.model.quant import quantize_linears

VOCAB, BLOCK = 96, 4
FAMILIES = {
    "llama": {},
    "qwen2": {"attention_bias": True},
    "qwen3": {"qk_norm": True},
    "mistral": {"sliding_window": 3},  # shorter than PROMPTS: the window's keys in the kernel
    "gemma2": {
        "sliding_window": 3, "sliding_window_layers": (0,), "hidden_act": "gelu_pytorch_tanh",
        "embedding_scale": 8.0, "post_norms": True, "attn_logit_softcapping": 1.0,
        "query_pre_attn_scalar": 24,
    },
    "gemma3": {
        "sliding_window": 3, "sliding_window_layers": (0,), "hidden_act": "gelu_pytorch_tanh",
        "embedding_scale": 8.0, "post_norms": True, "qk_norm": True, "rope_local_theta": 1e4,
        "rope_theta": 1e6,
    },
}  # fmt: skip


def _model(family: str, quantization: str, dtype: torch.dtype) -> llama.Transformer:
    # intermediate 80: down_proj's inputs end in a partial block of 32 when quantized.
    cfg = ModelConfig(family, VOCAB, 64, 80, 2, 4, 2, 16, 64, **FAMILIES[family])
    torch.manual_seed(0)
    model = build_model(cfg)
    with torch.no_grad():  # norms near 1, as trained ones are; the rest large enough to matter
        weights = {
            n: torch.randn_like(p) * 0.2 + ("norm" in n) for n, p in model.state_dict().items()
        }
    with torch.device("meta"):
        model = build_model(cfg)
    dense = quantize_linears(model, fuse_projections(weights, 2), quantization, dtype)
    model.load_weights(dense)
    return model.eval()


# Each step: (request, new tokens); request r's prompt is PROMPTS[r]. Step 2 holds a decode
# (r0), a prompt's second chunk (r1) and a first prefill (r2); step 3 only decodes.
PROMPTS = [[5, 9, 3, 7, 2, 8, 1], [4, 4, 6, 10, 11, 12, 13, 14, 15], [20, 21, 22]]
STEPS = [[(0, 7), (1, 5)], [(0, 1), (1, 4), (2, 3)], [(0, 1), (1, 1), (2, 1)]]


def _run(model: llama.Transformer, executor: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The final hidden states of each step, and the K/V caches after the last."""
    kv = KVCacheManager(16, BLOCK)
    runner = ModelRunner(model, kv.num_blocks, BLOCK, get_backend("cpu", model.device), executor)
    for cache in (c for pair in runner.kv_caches for c in pair):
        cache.zero_()  # the pool is not zeroed: slots never written would differ between runs
    requests = [
        Request(str(i), p, SamplingParams(max_tokens=4), 4, [], seed=0)
        for i, p in enumerate(PROMPTS)
    ]
    hidden = []
    for step in STEPS:
        scheduled = []
        for i, n in step:
            r = requests[i]
            if r.num_computed_tokens == r.num_tokens:  # a decode: the token sampled last step
                r.all_token_ids.append(30 + i)
            assert kv.allocate(r, n)
            scheduled.append((r, n))
        batch = runner.prepare_inputs(step_message(scheduled))
        hidden.append(model(batch.input_ids, batch.positions, batch.ctx))
        for r, n in scheduled:
            r.num_computed_tokens += n
    return hidden, [c for pair in runner.kv_caches for c in pair]


@pytest.mark.parametrize(
    "quantization,dtype",
    [
        ("none", "float32"),
        ("none", "bfloat16"),
        ("int8", "float32"),
        ("int4", "float32"),
        ("int4", "bfloat16"),
    ],
)
@pytest.mark.parametrize("family", FAMILIES)
def test_fused_layers_match_the_modules(family, quantization, dtype):
    dtype = getattr(torch, dtype)
    model = _model(family, quantization, dtype)
    native, native_kv = _run(model, "fused")
    modules, modules_kv = _run(model, "modules")
    assert modules[0].float().std() > 0.5  # not a comparison of near-zero tensors
    # The same kernels in the same order; only Qwen3's and Gemma 3's head norms differ (C++
    # against torch's fallback for strided heads), by rounding, which can move a quantized
    # activation's code.
    tol = {"none": 1e-5, "int8": 1e-3, "int4": 1e-3}[quantization]
    tol = tol if dtype == torch.float32 else 2e-2
    for ours, theirs in zip(native + native_kv, modules + modules_kv, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=tol, atol=tol)


def test_a_bad_weight_list_is_an_error_not_a_crash():
    model = _model("llama", "int4", torch.float32)
    layer = model.model.layers[0]
    layer.attention_args = layer.attention_args._replace(weights=layer.attention_args.weights[:2])
    kv = KVCacheManager(4, BLOCK)
    runner = ModelRunner(model, kv.num_blocks, BLOCK, get_backend("cpu", model.device), "fused")
    r = Request("0", PROMPTS[0], SamplingParams(max_tokens=1), 1, [], seed=0)
    assert kv.allocate(r, r.num_tokens)
    batch = runner.prepare_inputs(step_message([(r, r.num_tokens)]))
    with pytest.raises(RuntimeError, match="decoder_attention: 3 weights, not 2"):
        model(batch.input_ids, batch.positions, batch.ctx)
