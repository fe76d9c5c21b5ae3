"""How many KV blocks the pool gets, and the prefix cache's key for a model: the KV cache
manager for a model and an engine configuration.

The pool is CPU bookkeeping (kv_cache_manager.py); its size is set here, once, from the
model's K/V bytes per token, the configuration and the memory the device has available.
"""

import logging

from tinyllm.engine.config import EngineConfig
from tinyllm.engine.sched.kv_cache_manager import KVCacheManager
from tinyllm.engine.worker.model_runner import kv_bytes_per_token
from tinyllm.host.memory import available_bytes
from tinyllm.model.attention.int8_cache import cache_dtype
from tinyllm.model.llama import Transformer
from tinyllm.model.quant import describe_weights

log = logging.getLogger("tinyllm")


def build_kv_cache_manager(model: Transformer, cfg: EngineConfig, max_len: int) -> KVCacheManager:
    """The paged pool, or the slot baseline: the same manager with blocks of max_len tokens.

    `num_blocks` when given; else the fewest blocks of what `kv_cache_memory` holds, what
    `max_num_seqs` requests of `max_len` tokens could ever use, and half the memory still
    available on the device. The pool's pages are touched only as blocks are written, so a
    large pool costs nothing up front, but one larger than the machine can back would fail
    as it fills; the other half is left for activations and whatever else the machine runs.
    An encoder keeps no K/V: its pool is bookkeeping for max_num_seqs prompts, with no memory."""
    per_token = kv_bytes_per_token(model, cfg.kv_cache_dtype)
    block_size = max_len if cfg.kv_cache == "slot" else cfg.block_size
    caching = cfg.enable_prefix_caching and cfg.kv_cache == "paged"
    if per_token == 0:  # an encoder: its blocks are bookkeeping, and cost no memory
        num_blocks = cfg.num_blocks or cfg.max_num_seqs * -(-max_len // block_size)
        log.info("an encoder keeps no K/V: no KV memory, %d blocks of bookkeeping", num_blocks)
        return KVCacheManager(num_blocks, block_size, caching, extra_key=cache_key(model))
    unit = per_token * block_size
    if cfg.num_blocks is None and cfg.kv_cache_memory < unit:
        what = f"one slot of {max_len} tokens" if cfg.kv_cache == "slot" else "one block"
        raise ValueError(
            f"kv_cache_memory={cfg.kv_cache_memory} bytes cannot hold {what} ({unit} bytes); "
            "raise kv_cache_memory or lower max_model_len"
        )
    limits = {}  # why -> blocks; the first of the smallest wins, so a setting given beats a tie
    if cfg.num_blocks is not None:
        limits["num_blocks"] = cfg.num_blocks
    else:
        limits[f"kv_cache_memory {cfg.kv_cache_memory / 2**20:.0f} MiB"] = (
            cfg.kv_cache_memory // unit
        )
    if cfg.num_blocks is None or cfg.kv_cache == "slot":
        seqs = f"max_num_seqs {cfg.max_num_seqs} x max_model_len {max_len}"
        limits[seqs] = cfg.max_num_seqs * -(-max_len // block_size)
    available = available_bytes(model.device) if cfg.num_blocks is None else None
    if available is not None:
        limits[f"half the {available / 2**20:.0f} MiB available"] = available // 2 // unit
    reason, num_blocks = min(limits.items(), key=lambda item: item[1])
    if num_blocks < 1:
        raise ValueError(
            f"{available} bytes of memory are available: half of it cannot hold one KV block "
            f"({unit} bytes); free memory, or set num_blocks to size the cache yourself"
        )
    tokens = num_blocks * block_size
    log.info(
        "%s KV cache: %d blocks x %d tokens = %d tokens (%.0f MiB of %s K/V, limited by %s)",
        cfg.kv_cache,
        num_blocks,
        block_size,
        tokens,
        tokens * per_token / 2**20,
        str(cache_dtype(cfg.kv_cache_dtype, model.dtype)).removeprefix("torch."),
        reason,
    )
    if tokens < max_len:
        log.warning(
            "the KV cache holds %d tokens, fewer than the context (%d): max_model_len is cut to "
            "%d, so a request finishes with 'length' there and a longer prompt is refused; "
            "raise num_blocks/kv_cache_memory to lift it",
            tokens,
            max_len,
            tokens,
        )
    return KVCacheManager(num_blocks, block_size, caching, extra_key=cache_key(model))


def cache_key(model: Transformer) -> str:
    """What besides its tokens sets a block's K/V: the architecture, weight format and dtype."""
    return f"{model.config!r} {describe_weights(model)}"
