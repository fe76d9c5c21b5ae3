"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, SmolLM) in one readable file.

Parameter names match Hugging Face's, so every loader produces one state dict format.
The model knows nothing about scheduling or memory: it runs one flat batch of tokens,
`forward(input_ids, positions, ctx)`, where `ctx` (built once per step by the model runner)
carries the attention metadata, the attention backend and each layer's K/V cache. Every token
of every request in the step goes through the linear layers as one (N, hidden) matrix; only
attention needs to know which tokens belong together, and the backend reads that from the
metadata.
"""

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tinyllm.model.attention import ForwardContext
from tinyllm.model.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in fp32 like the reference, so bf16/fp16 runs keep the same statistics.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def _llama3_inv_freq(inv_freq: Tensor, scaling: dict) -> Tensor:
    """Llama 3.1's frequency-dependent RoPE scaling (long wavelengths stretched by `factor`)."""
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_ctx = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_ctx / wavelen - low) / (high - low)
    scaled = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
    return torch.where(mid, scaled, out)


class Rope:
    """Rotary embedding tables; `at(positions)` gives the cos/sin for any positions."""

    def __init__(self, config: ModelConfig, device: torch.device | str = "cpu"):
        d = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        scaling = config.rope_scaling or {}
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif kind == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif kind not in (None, "default"):
            raise ValueError(f"unsupported rope scaling {kind!r}: tinyllm supports llama3, linear")
        n = config.max_position_embeddings
        freqs = torch.outer(torch.arange(n, dtype=torch.float64), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)  # HF's rotate_half layout
        self.cos = emb.cos().float().to(device)
        self.sin = emb.sin().float().to(device)

    def at(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """positions (N,) -> cos, sin of shape (N, 1, head_dim), broadcast over heads."""
        return self.cos[positions][:, None], self.sin[positions][:, None]


def _rotate_half(x: Tensor) -> Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return (x * cos + _rotate_half(x) * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, c: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.scale = c.head_dim**-0.5
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx: ForwardContext) -> Tensor:
        N = x.shape[0]
        q = self.q_proj(x).view(N, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(N, self.n_kv, self.head_dim)
        v = self.v_proj(x).view(N, self.n_kv, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_cache, v_cache = ctx.kv_caches[self.layer]
        out = ctx.backend.forward(q, k, v, k_cache, v_cache, ctx.meta, self.scale)
        return self.o_proj(out.reshape(N, -1))


class MLP(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c, layer)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx: ForwardContext) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """HF's `model.*` submodule: embeddings, layers and the final norm."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c, i) for i in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope: Rope | None = None

    def load_weights(self, state_dict: dict[str, Tensor]) -> None:
        """Load HF-named weights; a missing or unexpected tensor is an error, not a warning."""
        state_dict = dict(state_dict)
        if self.config.tie_word_embeddings:
            state_dict.pop("lm_head.weight", None)
        own = {k for k, _ in self.named_parameters()}
        missing, unexpected = own - state_dict.keys(), state_dict.keys() - own
        if missing or unexpected:
            raise ValueError(
                f"weights do not match the {self.config.architecture} model: "
                f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
            )
        self.load_state_dict(state_dict, strict=False, assign=True)
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope = Rope(self.config, self.lm_head.weight.device)

    @torch.inference_mode()
    def forward(self, input_ids: Tensor, positions: Tensor, ctx: ForwardContext) -> Tensor:
        """input_ids, positions (N,) -> final hidden states (N, hidden); logits are a separate
        step so that only the positions that sample are projected onto the vocabulary."""
        cos, sin = self.rope.at(positions)
        h = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            h = layer(h, cos, sin, ctx)
        return self.model.norm(h)

    @torch.inference_mode()
    def logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(hidden).float()
