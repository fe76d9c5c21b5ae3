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
  `all_reduce` hook to an in-place torch.distributed.all_reduce over `group`, which both layer
  executors (DecoderLayer.forward and forward_fused) call on those outputs before the residual
  add. After it every rank holds the same sum (an all-reduce gives every rank the same bits),
  so the residual stream, the norms and the final hidden states are the same on every rank.
- The embeddings and the LM head are replicated, as the loader reads them (loaders/sharding.py
  says why: splitting them by vocabulary would save each rank vocab x hidden of memory but add
  an all-reduce of the embeddings and a gather of the logits to every step). Sampling happens
  on rank 0 only; the other ranks' logits are the same and go unused.
- Biases: o_proj and down_proj have none in these models (model/llama.py builds them without
  one, and the loader refuses a checkpoint that has one as an unexpected tensor), so nothing
  would be added once per rank where it should be added once. Qwen2's q/k/v biases are
  column-parallel: each rank adds its own heads' part.

A model that runs in one process never gets here: its hooks stay None, and a layer's cost is a
None check on each of its two outputs.
"""

from functools import partial

import torch.distributed as dist

from tinyllm.model.llama import Transformer


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
            layer.all_reduce = partial(dist.all_reduce, group=group)
    return model
