"""What a model is: one dataclass filled by every loader (GGUF metadata or HF config.json)."""

from dataclasses import dataclass, field

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


class ModelLoadError(ValueError):
    """A model file or directory is missing, truncated or malformed."""


class UnsupportedModelError(ValueError):
    """The model file is readable but describes something tinyllm does not run."""


@dataclass
class ModelConfig:
    architecture: str  # one of SUPPORTED_ARCHITECTURES ("smollm" models are "llama")
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # Hugging Face's rope_scaling dict; only {"rope_type": "llama3", ...} changes anything.
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm on each head of q and k before RoPE
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture {self.architecture!r}; "
                f"tinyllm runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
