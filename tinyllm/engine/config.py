"""The engine's knobs: EngineConfig, and speculative decoding's own."""

import dataclasses
import json
from dataclasses import dataclass


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (spec_decode/speculator.py), with vLLM's `speculative_config` names;
    method "ngram" (prompt lookup) is the one there is."""

    # The defaults measured best on `tinyllm bench grounded` (docs/MEASUREMENTS.md,
    # "Speculative decoding"): each draft a step verifies costs it 15-20% more on the default model.
    num_speculative_tokens: int = 6
    method: str = "ngram"
    prompt_lookup_min: int = 1  # a sampled request's is at least 2 (spec_decode/speculator.py)
    prompt_lookup_max: int = 5
    # Above this many decoding requests in a step nothing is drafted: the weights are already
    # shared by enough rows (engine/spec_decode/speculator.py).
    max_batch: int = 4

    def __post_init__(self) -> None:
        if self.method != "ngram":
            raise ValueError(f"speculative_config method={self.method!r}: tinyllm has 'ngram'")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "max_batch"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative_config {name}={value!r} must be an integer >= 1")
        if not isinstance(self.prompt_lookup_max, int) or (
            self.prompt_lookup_max < self.prompt_lookup_min
        ):
            raise ValueError(
                f"speculative_config prompt_lookup_max={self.prompt_lookup_max!r} must be an "
                f"integer >= prompt_lookup_min ({self.prompt_lookup_min})"
            )

    @classmethod
    def parse(cls, value: "dict | str | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """From LLM's dict, the CLI's JSON text, or as is; an unknown key is an error."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(
                "speculative_config must be a dict such as "
                '{"method": "ngram", "num_speculative_tokens": 5}'
            )
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"speculative_config: unknown key(s) {unknown}; known: {sorted(known)}"
            )
        return cls(**value)


@dataclass
class EngineConfig:
    kv_cache: str = "paged"  # "paged", or "slot": one block of max_model_len tokens per request
    block_size: int = 16
    num_blocks: int | None = None  # None: as many as kv_cache_memory holds
    # Bytes of K and V, all layers; per rank under tensor parallelism (each holds its KV heads).
    kv_cache_memory: int = 2 << 30
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
    # tinyllm.model.layer_executor
    layer_executor: str = "auto"
    # Ranks the model is split over (engine/worker/transport.py): this process and N - 1 workers.
    tensor_parallel_size: int = 1
    seed: int = 0
    # Speculative decoding (engine/spec_decode/speculator.py): vLLM's dict, e.g. {"method": "ngram",
    # "num_speculative_tokens": 5}, its JSON text, or a SpeculativeConfig; None: off.
    speculative_config: SpeculativeConfig | dict | str | None = None

    def __post_init__(self) -> None:
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.kv_cache not in ("paged", "slot"):
            raise ValueError(f"kv_cache={self.kv_cache!r}: choose 'paged' or 'slot'")
        positive = ("block_size", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory")
        for name in (*positive, "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        for name in ("num_blocks", "max_model_len"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
