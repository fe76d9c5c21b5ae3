"""Loading a model as LLM does, and running it directly on whole prompts through the model
runner, for weight and logit tests."""

import math
from pathlib import Path

import torch
from torch import Tensor

from tinyllm.engine.sampling_params import SamplingParams
from tinyllm.engine.sched.kv_cache_manager import KVCacheManager
from tinyllm.engine.sched.request import Request
from tinyllm.engine.sched.scheduler import step_message
from tinyllm.engine.worker.model_runner import ModelRunner
from tinyllm.loaders.model_loader import LoadConfig, load_model
from tinyllm.model.attention import get_backend
from tinyllm.model.llama import Transformer

# The model's stacked projections, and the Hugging Face checkpoint's parts of each, in order.
STACKED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def load(
    path: str | Path,
    dtype: str = "float32",
    quantization: str = "none",
    max_model_len: int | None = None,
) -> Transformer:
    """The model at `path` as LLM loads it on the CPU (loaders/model_loader.load_model); with
    the defaults, the checkpoint's weights in fp32, dense (GGUF blocks dequantized)."""
    config = LoadConfig(
        model=str(path), dtype=dtype, quantization=quantization, max_model_len=max_model_len
    )
    return load_model(config, torch.device("cpu")).model


def checkpoint_weights(model: Transformer, split: bool = True) -> dict[str, Tensor]:
    """A dense model's weights under a Hugging Face checkpoint's names: with `split`, q/k/v and
    gate/up apart again (Phi-3's checkpoints keep them stacked). A tied LM head is not among
    them: it is the embeddings."""
    c = model.config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    rows = {"self_attn.qkv_proj": (q, kv, kv), "mlp.gate_up_proj": (c.intermediate_size,) * 2}
    weights = {}
    for name, w in model.named_parameters():
        module, _, kind = name.rpartition(".")
        own = next((own for own in STACKED if module.endswith("." + own)), None)
        if own is None or not split:
            weights[name] = w.detach()
            continue
        layer = module.removesuffix(own)
        for part, part_w in zip(STACKED[own], w.detach().split(rows[own]), strict=True):
            weights[f"{layer}{part}.{kind}"] = part_w
    return weights


def prompt_logits(
    model: Transformer,
    prompts: list[list[int]],
    block_size: int = 4,
    backend: str = "auto",
    executor: str = "auto",
):
    """Each prompt's logits at every position, (len, vocab), all prompts in one flat batch,
    with the attention backend an engine would use (on the CPU, whole layers as C++ ops), the
    layers run by `executor` (model/layer_executor.py)."""
    kv = KVCacheManager(sum(math.ceil(len(p) / block_size) for p in prompts), block_size)
    runner = ModelRunner(
        model,
        kv.num_blocks,
        block_size,
        get_backend(backend, model.device, model.config.sliding_window),
        layer_executor=executor,
    )
    requests = [
        Request(str(i), p, SamplingParams(max_tokens=1), 1, [], seed=0)
        for i, p in enumerate(prompts)
    ]
    for r in requests:
        assert kv.allocate(r, r.num_tokens)
    batch = runner.prepare_inputs(step_message([(r, r.num_tokens) for r in requests]))
    with torch.inference_mode():
        logits = model.logits(model(batch.input_ids, batch.positions, batch.ctx))
    by_id, start = {}, 0
    for req_id, n in batch.rows:
        by_id[req_id] = logits[start : start + n]
        start += n
    return [by_id[str(i)] for i in range(len(prompts))]


def transformers_logits(model: torch.nn.Module, prompt: list[int]) -> Tensor:
    """transformers' logits at every position of one prompt alone (LongRoPE picks its factors
    from each call's length)."""
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0]
