"""What a model is: one dataclass filled by every loader (GGUF metadata or HF config.json)."""

import dataclasses
import logging
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = (
    "llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "qwen3_moe", "mixtral",
    "olmoe", "gpt_oss", "bert", "xlm-roberta", "nomic_bert",
)  # fmt: skip
# The encoders among them (model/encoder.py): bidirectional, pooled, never generating.
ENCODER_ARCHITECTURES = ("bert", "xlm-roberta", "nomic_bert")

# Families close to the supported ones that tinyllm refuses, and why: what their layers do that
# the model files (model/llama.py, model/gemma.py) and the attention backends do not. Keyed by
# Hugging Face's model_type, which is also their GGUF general.architecture.
REFUSED_ARCHITECTURES = {
    "phi": "LayerNorms, attention and MLP in parallel, biases and a GELU MLP",
    "gemma": (
        "Gemma 1's layers: (1 + weight) RMSNorms, scaled embeddings and a GeGLU MLP without the "
        "norms after attention and MLP that tinyllm's Gemma 2/3 model has"
    ),
}
REFUSED_ARCHITECTURES["phi2"] = REFUSED_ARCHITECTURES["phi"]  # Phi-2's GGUF architecture
REFUSED_ARCHITECTURES["qwen2_moe"] = (
    "a shared expert, with its own sigmoid gate, beside the routed experts (model/moe.py has "
    "routed experts only)"
)
REFUSED_ARCHITECTURES["qwen2moe"] = REFUSED_ARCHITECTURES["qwen2_moe"]  # its GGUF architecture


class ModelLoadError(ValueError):
    """A model file or directory is missing, truncated or malformed."""


class UnsupportedModelError(ValueError):
    """The model file is readable but describes something tinyllm does not run."""


@dataclass
class ModelConfig:
    architecture: str  # one of SUPPORTED_ARCHITECTURES ("smollm" models are "llama"; Gemma 3's
    # text model, model_type gemma3_text, is "gemma3")
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
    # Hugging Face's rope_scaling dict, of rope_type llama3, linear, longrope or yarn
    # (model.Rope); longrope's carries its attention_factor, worked out by the loader.
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    o_proj_bias: bool = False  # gpt-oss: bias on o_proj too
    # gpt-oss: a learned logit per query head in each softmax's denominator, with no value.
    attention_sinks: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm on each head of q and k before RoPE
    rotary_dim: int | None = None  # RoPE on each head's first rotary_dim dims (None: all of them)
    # Sliding-window attention (Mistral): a query at position p sees keys max(0, p - W + 1)..p,
    # itself and the W - 1 before it, as transformers' mask does. None: the whole context.
    sliding_window: int | None = None
    # The layers that slide (Qwen2's and Qwen3's from max_window_layers on); None: every layer.
    sliding_window_layers: tuple[int, ...] | None = None
    # Gemma 2/3 (model/gemma.py); the defaults leave the other families as they are.
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" or "gelu_pytorch_tanh" (GeGLU)
    embedding_scale: float | None = None  # embeddings times this (Gemma: sqrt(hidden_size))
    post_norms: bool = False  # RMSNorms on the attention and MLP outputs before their adds
    attn_logit_softcapping: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2)
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5; None: head_dim
    rope_local_theta: float | None = None  # RoPE base of the sliding layers, unscaled (Gemma 3)
    # Mixture of experts (Qwen3-MoE, Mixtral, OLMoE; model/moe.py): 0 experts is a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k: the experts each token runs
    moe_intermediate_size: int = 0  # each expert's FFN width
    norm_topk_prob: bool = False  # the top-k probabilities renormalised to sum to 1
    # The layers with a dense MLP in a MoE model (Qwen3-MoE's mlp_only_layers, decoder_sparse_step).
    dense_mlp_layers: tuple[int, ...] = ()
    # gpt-oss: biases on the router and the experts' projections; the router's softmax over its
    # top-k logits (not the top-k of its softmax); the experts' clamped SwiGLU,
    # (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = min(gate, limit).
    moe_bias: bool = False
    softmax_after_topk: bool = False
    swiglu_limit: float | None = None  # None: the experts' activation is SiLU(gate) * up
    swiglu_alpha: float = 1.702
    # OLMoE: q_norm and k_norm span all heads' width (one norm of q's whole row), not one head.
    qk_norm_all_heads: bool = False
    # Pooling models (embeddings, rerank; engine/pooling): what the runner does with a finished
    # prompt's hidden states instead of sampling. Set from sentence-transformers' modules.json and
    # 1_Pooling/config.json, a GGUF's pooling_type, or --pooling for any generation model.
    is_causal: bool = True  # False: an encoder, each prompt's tokens see all of it (never chunked)
    pooling: str | None = None  # "cls", "mean" or "last"; None: a generation model
    normalize: bool = False  # embeddings L2-normalized (sentence-transformers' Normalize module)
    num_labels: int = 0  # a cross-encoder's classifier outputs: the model's classify(pooled)
    # sentence-transformers' prompts (config_sentence_transformers.json): name -> the text put
    # before an input to embed (Qwen3-Embedding's "query" instruction), and the one an input
    # gets when it names none (None: no prompt).
    prompts: dict = field(default_factory=dict)
    default_prompt_name: str | None = None
    # Encoders (model/bert.py: BERT, XLM-RoBERTa; model/nomic_bert.py, rotary): token type
    # embeddings and a LayerNorm after each sublayer; hidden_act is their MLP's activation
    # (NomicBert's gate's); num_kv_heads equals num_heads.
    layer_norm_eps: float = 1e-12
    type_vocab_size: int = 1  # rows of the token type table (BERT's checkpoints have 2)
    position_offset: int = 0  # XLM-R: the token at position p reads row p + padding_idx + 1
    # A BERT cross-encoder's pair: tokens after the first of this token (its tokenizer's [SEP])
    # take token type 1, as the tokenizer types a (query, document) pair; None: all type 0.
    segment_token_id: int | None = None
    # Above 1, this is one rank's part of a model split over that many (see shard): the head
    # counts and intermediate_size above are the rank's own.
    tensor_parallel_size: int = 1
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise unsupported_architecture(self.architecture, self.architecture)
        if self.rotary_dim is not None and not (0 < self.rotary_dim <= self.head_dim):
            raise UnsupportedModelError(
                f"rotary_dim {self.rotary_dim} must be in 1..head_dim ({self.head_dim})"
            )
        rotated = self.rotary_dim or self.head_dim
        if rotated % 2:
            raise UnsupportedModelError(f"RoPE needs an even number of rotated dims, not {rotated}")
        scaling = self.rope_scaling or {}
        longrope = scaling.get("rope_type") == "longrope"
        for key in ("short_factor", "long_factor") if longrope else ():
            if len(scaling[key]) != rotated // 2:
                raise ModelLoadError(
                    f"longrope {key} has {len(scaling[key])} values; {rotated} rotated dims "
                    f"need {rotated // 2}"
                )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ModelLoadError(f"sliding_window {self.sliding_window} must be >= 1")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ModelLoadError(
                f"num_experts_per_tok {self.num_experts_per_tok} must be in 1..num_experts "
                f"({self.num_experts})"
            )
        acts = ("silu", "gelu_pytorch_tanh") + (() if self.is_causal else ("gelu",))
        if self.hidden_act not in acts:
            raise UnsupportedModelError(
                f"unsupported hidden_act {self.hidden_act!r}; needs {' or '.join(acts)}"
            )
        if self.pooling not in (None, "cls", "mean", "last"):
            raise UnsupportedModelError(f"pooling {self.pooling!r}: cls, mean or last")
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer `layer` runs a mixture of experts (model/moe.py) instead of the MLP."""
        return self.num_experts > 0 and layer not in self.dense_mlp_layers

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer`, or None where it attends to the whole context."""
        layers = self.sliding_window_layers
        return self.sliding_window if layers is None or layer in layers else None

    def shard(self, world_size: int) -> "ModelConfig":
        """One rank's part of this model split over `world_size` ranks (tensor parallelism):
        its query heads, KV heads and FFN widths (the experts' too), each this many divided by
        world_size. The model built from it has the rank's shapes, and its KV cache holds the
        rank's heads."""
        if world_size == 1:
            return self
        if not self.is_causal:
            raise ValueError(
                f"tensor parallelism does not split encoders ({self.architecture}); "
                "run it with tensor_parallel_size 1"
            )
        if self.qk_norm_all_heads:
            raise ValueError(
                f"tensor parallelism does not split {self.architecture}: its q/k norms span all "
                "heads, so each rank's heads would need the others' to normalise"
            )
        split = {
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "intermediate_size": self.intermediate_size,
            # Each rank holds every expert's slice of its FFN width, as of the dense MLP's.
            "moe_intermediate_size": self.moe_intermediate_size,
        }
        uneven = [f"{name} {n}" for name, n in split.items() if n % world_size]
        if uneven:
            # vLLM replicates KV heads over the ranks when there are fewer; tinyllm does not.
            few = self.num_kv_heads < world_size
            why = "; fewer KV heads than ranks, and KV heads are not replicated" if few else ""
            raise ValueError(
                f"tensor parallelism splits the query heads, KV heads and FFN width evenly "
                f"over the ranks: {', '.join(uneven)} do not divide by world_size {world_size}"
                f"{why}"
            )
        return dataclasses.replace(
            self,
            **{name: n // world_size for name, n in split.items()},
            tensor_parallel_size=self.tensor_parallel_size * world_size,
            extra=dict(self.extra),
        )


def unsupported_architecture(name: str, model_type: str) -> UnsupportedModelError:
    """The one-line error for a model tinyllm does not run: `name` as the file calls it (an HF
    class name or a GGUF architecture), and why, for the families close to Llama."""
    why = REFUSED_ARCHITECTURES.get(model_type)
    reason = f": it needs {why}, which tinyllm's models lack" if why else ""
    return UnsupportedModelError(
        f"{name} is not supported{reason}; tinyllm runs {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def serve_within_window(config: ModelConfig, window: int) -> None:
    """A model whose attention slides over the last `window` tokens (Phi-3-mini-4k: 2047 of
    4096), served up to `window` tokens, where full attention is the same and cheaper, and
    every attention backend (CUDA's too, which has no window) runs it. The engine caps
    max_model_len at the context set here."""
    if not 0 < window < config.max_position_embeddings:
        return
    log.warning(
        "%s sets sliding_window=%d, shorter than its context %d; tinyllm serves it up to its "
        "window, at most %d tokens (max_model_len), where full attention is the same",
        config.architecture,
        window,
        config.max_position_embeddings,
        window,
    )
    config.max_position_embeddings = window
