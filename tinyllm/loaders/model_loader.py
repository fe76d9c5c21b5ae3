"""The model a process runs, ready: `load_model(config, device, rank, world_size)` resolves the
weights' format for the device, reads the checkpoint (each tensor-parallel rank only its own
shards: loaders/sharding.py), quantizes the linear layers and places the rest on the device.
LLM calls it for the one model it runs; a tensor-parallel worker calls it for its rank."""

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import gguf
import torch
from torch.overrides import TorchFunctionMode

from tinyllm.host.memory import release_free_heap
from tinyllm.loaders.dummy import load_dummy
from tinyllm.loaders.gguf import PROGRESS_BYTES
from tinyllm.loaders.load_config import LoadConfig
from tinyllm.loaders.sharding import Shard, read_shard
from tinyllm.loaders.source import open_checkpoint, open_model
from tinyllm.model.families import Model, build_model
from tinyllm.model.precision import resolve_dtype, resolve_quantization
from tinyllm.model.quant import describe_weights, quantize_linears
from tinyllm.text.tokenizer import Tokenizer

log = logging.getLogger("tinyllm")


@dataclass
class LoadedModel:
    model: Model  # in eval mode, on the device; a rank's shards under tensor parallelism
    name: str
    path: Path
    tokenizer: Tokenizer
    reader: gguf.GGUFReader | None  # a GGUF file's, open: its metadata has generation defaults


class _SkipInit(TorchFunctionMode):
    """Skips torch.nn.init's random initialization while the model is built on the meta
    device: its weights come from the file. There nn.Embedding's normal_ runs through torch's
    Python decompositions, whose first use imports torch._dynamo and sympy: resident memory
    and load time spent on values never used."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":  # init_(tensor, ...) -> tensor
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


def load_model(
    config: LoadConfig, device: torch.device, rank: int = 0, world_size: int = 1
) -> LoadedModel:
    """The model `config` names, ready on `device`: with `world_size` above 1, rank `rank`'s
    part of it (its heads and FFN columns, ModelConfig.shard), read without the other ranks'."""
    shard = Shard(rank, world_size)
    start = time.perf_counter()
    dummy = config.load_format == "dummy"
    files = None if dummy else open_model(config.model)
    # Dummy weights are made in the format they run in: int4 where the kernels run.
    quantization, dtype = _formats(config, device, {4} if dummy else files.stored_bits)
    keep_stored = config.quantization == "auto"  # the file's own bits, not a forced width
    quantized = quantization != "none"
    if dummy:
        checkpoint = load_dummy(config.model, quantization, dtype)
    else:
        checkpoint = open_checkpoint(config.model, dtype, quantized, files)
    with torch.device("meta"), _SkipInit():
        net = build_model(checkpoint.config.shard(world_size))
    names = [name for name, _ in net.named_parameters(remove_duplicate=False)]
    params = sum(t.numel() for t in checkpoint.tensors.values())
    reader = files.reader if files else None
    big = reader is not None and len(reader.data) >= PROGRESS_BYTES
    weights = read_shard(checkpoint.tensors, names, checkpoint.config, shard, quantized, big)
    checkpoint.tensors.clear()  # `weights` holds what is read: freed as its layer is packed
    dense = quantize_linears(net, weights, quantization, dtype, keep_stored)
    net.load_weights({k: v.to(device) for k, v in dense.items()}, config.max_model_len)
    _log_loaded(checkpoint.name, params, net, shard, time.perf_counter() - start)
    loaded = LoadedModel(net.eval(), checkpoint.name, checkpoint.path, checkpoint.tokenizer, reader)
    del checkpoint, weights, dense  # the file as read: the model holds what it keeps
    release_free_heap()
    return loaded


def _formats(
    config: LoadConfig, device: torch.device, stored_bits: set[int]
) -> tuple[str, torch.dtype]:
    """The linear layers' quantization and the activations' dtype, logged with why."""
    quantization, why = resolve_quantization(config.quantization, stored_bits, device)
    if config.load_format == "dummy" and config.quantization == "auto" and quantization == "int4":
        why = "dummy weights default to int4"
    dtype, why_dtype = resolve_dtype(config.dtype, device)
    dtype_name = str(dtype).removeprefix("torch.")
    log.info("dtype %s (%s), quantization %s (%s)", dtype_name, why_dtype, quantization, why)
    return quantization, dtype


def _log_loaded(name: str, params: int, net: torch.nn.Module, shard: Shard, seconds: float) -> None:
    # Parameters as the checkpoint counts them; bytes as they sit in memory (dtype, packing).
    tensors = [*net.parameters(), *net.buffers()]
    size = sum(t.numel() * t.element_size() for t in tensors)
    part = f" (rank {shard.rank} of {shard.world_size}'s part)" if shard.world_size > 1 else ""
    log.info(
        "loaded %s: %.1fM parameters, %.0f MB resident%s (%s) on %s, in %.1f s",
        name,
        params / 1e6,
        size / 1e6,
        part,
        describe_weights(net),
        net.device,
        seconds,
    )
