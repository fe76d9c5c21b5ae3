"""Running a model directly on whole prompts through the model runner, for logit tests."""

import math

import torch

from tinyllm.engine.sampling_params import SamplingParams
from tinyllm.engine.sched.kv_cache_manager import KVCacheManager
from tinyllm.engine.sched.request import Request
from tinyllm.engine.sched.scheduler import step_message
from tinyllm.engine.worker.model_runner import ModelRunner
from tinyllm.model.attention import get_backend
from tinyllm.model.llama import Transformer


def prompt_logits(
    model: Transformer, prompts: list[list[int]], block_size: int = 4, backend: str = "auto"
):
    """Each prompt's logits at every position, (len, vocab), all prompts in one flat batch,
    with the attention backend an engine would use (on the CPU, whole layers as C++ ops)."""
    kv = KVCacheManager(sum(math.ceil(len(p) / block_size) for p in prompts), block_size)
    runner = ModelRunner(
        model,
        kv.num_blocks,
        block_size,
        get_backend(backend, model.device, model.config.sliding_window),
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
