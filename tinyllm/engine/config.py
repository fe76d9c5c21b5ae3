"""The engine's knobs: EngineConfig, and speculative decoding's own."""

import dataclasses
import json
from dataclasses import dataclass

from tinyllm.host.options import option
from tinyllm.model.choices import (
    ATTENTION_BACKENDS,
    KV_CACHE_DTYPES,
    LAYER_EXECUTORS,
    POOLING_TYPES,
)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (spec_decode/speculator.py), with vLLM's `speculative_config` names;
    method "ngram" (prompt lookup) is the one there is."""

    # The defaults measured best on `tinyllm bench grounded` (docs/MEASUREMENTS.md,
    # "Speculative decoding"): each draft a step verifies adds to its cost.
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


KV_CACHES = ("paged", "slot")
# The speculative decoding settings --speculative-config's help shows, at their defaults.
_SPECULATIVE_EXAMPLE = json.dumps(
    {
        name: getattr(SpeculativeConfig, name)
        for name in ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")
    }
)


@dataclass
class EngineConfig:
    """The engine's settings. Those declared with `option` are also command-line flags
    (entrypoints/args.py makes them from these fields); the others are LLM's arguments only."""

    kv_cache: str = option(
        "paged",
        "paged: blocks allocated as sequences grow; slot: a whole context per sequence (the "
        "baseline)",
        choices=KV_CACHES,
    )
    block_size: int = option(16, "tokens per KV block")
    kv_cache_dtype: str = option(
        "auto",
        "auto: K/V stored in the model's dtype; int8: int8 codes, an fp32 scale per 32 of a "
        "token's head dims (0.56x a bf16 cache's memory and reads; cpu and reference "
        "backends)",
        choices=KV_CACHE_DTYPES,
    )
    # Bytes of K and V, all layers; per rank under tensor parallelism (each holds its KV heads).
    kv_cache_memory: int = 2 << 30
    num_blocks: int | None = option(
        None, f"KV blocks in the pool (default: as many as {kv_cache_memory >> 30} GiB holds)"
    )
    max_num_seqs: int = option(64, "sequences decoded together")
    max_model_len: int | None = option(
        None, "context length, prompt and output (default: the model's)"
    )
    # A prompt longer than what is left of a step's tokens is prefilled in chunks over several
    # steps, so running streams keep decoding meanwhile.
    max_num_batched_tokens: int = option(
        512,
        "tokens one engine step may run (decode tokens plus prefill chunks); a longer prompt is "
        "prefilled in chunks",
    )
    # The paged cache only: the slot baseline has no full blocks to share.
    enable_prefix_caching: bool = option(
        True,
        "share the KV blocks of repeated prompt prefixes (system prompts, chat histories) "
        "between requests instead of recomputing them",
    )
    attention_backend: str = option(
        "auto",
        "auto: the in-place kernel for the device, else the reference gather + SDPA",
        choices=ATTENTION_BACKENDS,
    )
    # Speculative decoding (engine/spec_decode/speculator.py): vLLM's dict, its JSON text, or a
    # SpeculativeConfig; None: off.
    speculative_config: SpeculativeConfig | dict | str | None = option(
        None,
        f"speculative decoding, vLLM's JSON: '{_SPECULATIVE_EXAMPLE}' (those are the "
        "defaults): draft tokens looked up in the context, verified in one pass; the same "
        "greedy tokens, faster where the answer repeats its context (default: off)",
        metavar="JSON",
        check=SpeculativeConfig.parse,
    )
    layer_executor: str = option(
        "auto",
        "how decoder layers run: fused: two C++ ops per layer (CPU, the cpu attention backend, "
        "float32/bfloat16); modules: one module call per step (any device); auto: fused where "
        "it can run",
        choices=LAYER_EXECUTORS,
    )
    # This process and N - 1 workers (engine/worker/transport.py).
    tensor_parallel_size: int = option(
        1,
        "split the model over N ranks: this process and N-1 workers on this host, or the N "
        "processes torchrun starts (docs/GUIDE.md, 'Tensor parallelism'); each rank gets "
        "its share of --threads",
        aliases=("-tp",),
    )
    # Pooling models (engine/pooling_params.py, engine/worker/pooler.py): the engine embeds or
    # scores its prompts instead of generating.
    pooling: str | None = option(
        None,
        "serve the model as an embedding model: each input's final hidden states pooled by its "
        "last token, their mean, or the first (cls) token, then L2-normalized; generation is "
        "refused (default: as the model's sentence-transformers config says, else generation)",
        choices=POOLING_TYPES,
    )
    classifier_from_token: str | None = option(
        None,
        "serve a decoder as a reranker (vLLM's name): its score is the probability of the last "
        "of these comma-separated tokens against the others at an input's last token, and the "
        "score and rerank APIs write Qwen3-Reranker's prompt (for it: no,yes)",
        metavar="TOKENS",
    )
    # Draws the seeds of requests that set none (no flag: each command's --seed is its own).
    seed: int = 0

    def __post_init__(self) -> None:
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.kv_cache not in KV_CACHES:
            raise ValueError(f"kv_cache={self.kv_cache!r}: choose 'paged' or 'slot'")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            choices = ", ".join(KV_CACHE_DTYPES)
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r}: choose one of {choices}")
        positive = ("block_size", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory")
        for name in (*positive, "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        tokens = self.classifier_from_token
        if tokens is not None and (len(tokens.split(",")) < 2 or "" in tokens.split(",")):
            raise ValueError(
                f"classifier_from_token={tokens!r}: give two or more tokens, comma-separated "
                "(Qwen3-Reranker: no,yes)"
            )
        for name in ("num_blocks", "max_model_len"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
