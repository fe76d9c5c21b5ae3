"""The engine's knobs, in one dataclass."""

from dataclasses import dataclass


@dataclass
class EngineConfig:
    kv_cache: str = "paged"  # "paged", or "slot": one block of max_model_len tokens per request
    block_size: int = 16
    num_blocks: int | None = None  # None: as many as kv_cache_memory holds
    kv_cache_memory: int = 2 << 30  # bytes of K and V, all layers
    max_num_seqs: int = 64
    max_model_len: int | None = None  # None: the model's context length
    # Tokens one step runs: decode tokens plus prefill chunks. A prompt longer than what is left
    # is prefilled in chunks over several steps, so running streams keep decoding meanwhile.
    max_num_batched_tokens: int = 512
    # Share the K/V of prompt prefixes (and earlier turns' answers) between requests; the
    # paged cache only (the slot baseline has no full blocks to share).
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"  # see tinyllm.model.attention.BACKENDS
    # How the decoder layers run: "fused" (C++ ops, CPU), "modules" or "auto"; see
    # tinyllm.engine.layer_executor
    layer_executor: str = "auto"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kv_cache not in ("paged", "slot"):
            raise ValueError(f"kv_cache={self.kv_cache!r}: choose 'paged' or 'slot'")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        for name in ("num_blocks", "max_model_len"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
