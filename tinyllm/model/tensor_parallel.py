"""Tensor parallelism on a loaded model: `apply_tp(model, group)`, one rewrite of a rank's model
(gpt-fast's `apply_tp`), not a flag threaded through every layer.

Each rank's model is its part of the whole one (loaders/model_loader.load_model with its rank
and world size; the split is loaders/sharding.py's, Megatron-LM's):
- qkv_proj and gate_up_proj are column-parallel: a rank holds its share of the query heads, KV
  heads and FFN columns, so its attention and its MLP's activation need nothing from another
  rank. KV heads are split, never replicated: each rank's KV cache holds its own heads, under
  the same block tables as every other rank's (one scheduler, one block allocator), and a
  model with fewer KV heads than ranks is refused when its config is split
  (ModelConfig.shard).
- o_proj and down_proj are row-parallel: a rank multiplies its share of their input columns,
  so its output is a partial sum of the layer's. apply_tp sets each decoder layer's
  `all_reduce` hook to `reduce_in_rank_order` over `group`, which DecoderLayer.forward calls,
  as modules or as C++ ops, on those outputs before the residual add: every
  rank gathers every rank's part and adds them in rank order, in fp32, rounding once to the
  activations' dtype. So every rank holds the same bits, and a token's bits do not depend on
  what shares its step, as without tensor parallelism (docs/DESIGN.md, "The same request
  gives the same bits"): gloo's all-reduce adds in an order that depends on the tensor's size
  (its chunks), and in bf16 it rounds after each addition; a prefix-cache hit, which runs a
  shorter chunk, then gave other logprobs than the full prompt.
- The embeddings and the LM head are replicated, as the loader reads them (loaders/sharding.py
  says why: splitting them by vocabulary would save each rank vocab x hidden of memory but add
  an all-reduce of the embeddings and a gather of the logits to every step). Sampling happens
  on rank 0 only; the other ranks' logits are the same and go unused.
- Biases: Qwen2's q/k/v biases are column-parallel: each rank adds its own heads' part.
  gpt-oss's o_proj and experts' down_proj biases are rank 0's alone (the other ranks hold
  zeros), so the all-reduce adds each once; its attention sinks split with the heads.

A model that runs in one process never gets here: its hooks stay None, and a layer's cost is a
None check on each of its two outputs.
"""

from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor

from tinyllm.model.llama import Transformer


def reduce_in_rank_order(x: Tensor, group: dist.ProcessGroup | None = None) -> None:
    """x <- the sum of every rank's x, added in rank order in fp32: the same bits on every
    rank, whatever x's size. An all-gather moves world_size times a decode row's few KB where
    an all-reduce moves about twice: on the CPU the call's latency, not its bytes, is the cost
    (docs/MEASUREMENTS.md, "Tensor parallelism on a CPU")."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    total = parts[0].float()
    for part in parts[1:]:
        total += part
    x.copy_(total)


def apply_tp(model: Transformer, group: dist.ProcessGroup | None = None) -> Transformer:
    """Make `model` (one rank's part, ModelConfig.tensor_parallel_size ranks in all) sum its
    row-parallel projections' outputs over `group` (None: the default process group), whose
    size must be the model's number of ranks. Returns the model, rewritten in place."""
    ranks, world_size = model.config.tensor_parallel_size, dist.get_world_size(group)
    if ranks != world_size:
        raise ValueError(
            f"the model is split over tensor_parallel_size {ranks} ranks, but the process "
            f"group has world_size {world_size}"
        )
    if world_size > 1:
        for layer in model.model.layers:
            layer.all_reduce = partial(reduce_in_rank_order, group=group)
    return model
