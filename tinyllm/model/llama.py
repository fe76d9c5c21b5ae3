"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Phi-3, SmolLM) in one readable file.

Every loader produces one state dict format, Hugging Face's names; the model stacks q/k/v and
gate/up into one matrix product each as it loads them (fuse_projections), as vLLM does; Phi-3's
checkpoints store them stacked already, under the model's own names.
The model knows nothing about scheduling or memory: it runs one flat batch of tokens,
`forward(input_ids, positions, ctx)`, where `ctx` (built once per step by the model runner)
carries the attention metadata, the attention backend, each layer's K/V cache and whether the
layers run as modules or as C++ ops (the runner's choice: tinyllm.model.layer_executor). Every
token of every request in the step goes through the linear layers as one (N, hidden) matrix; only
attention needs to know which tokens belong together, and the backend reads that from the
metadata. Under tensor parallelism the same model holds one rank's part (ModelConfig.shard), and
model/tensor_parallel.apply_tp gives each layer the all-reduce it calls after o_proj and
down_proj.
"""

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from tinyllm.model import layer_ops
from tinyllm.model.attention import ForwardContext
from tinyllm.model.config import ModelConfig
from tinyllm.model.quant import QuantLinear, cat_rows


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor, residual: Tensor | None = None):
        """The norm of x, or with `residual` the norm of x + residual and that sum: the residual
        add fused into the norm (see layer_ops.rms_norm)."""
        return layer_ops.rms_norm(x, self.weight, self.eps, residual)


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


def _longrope_inv_freq(inv_freq: Tensor, scaling: dict, context: int) -> Tensor:
    """Phi-3's LongRoPE: each frequency divided by its own factor, the long ones where the context
    served (max_model_len) exceeds the pretrained one. Chosen once, as vLLM and llama.cpp choose,
    not per sequence as transformers does: keys cached at one choice stay valid for the whole
    context, and outputs do not depend on what else is in the batch."""
    long = context > scaling["original_max_position_embeddings"]
    factors = scaling["long_factor" if long else "short_factor"]
    return inv_freq / torch.tensor(factors, dtype=torch.float64)


class Rope:
    """Rotary embedding tables: cos and sin of each position's angles, (positions, rotary dims /
    2) in fp32, for layer_ops.rotary. `context`: the longest sequence served (max_model_len;
    None: the model's context), which picks LongRoPE's factors."""

    def __init__(
        self, config: ModelConfig, device: torch.device | str = "cpu", context: int | None = None
    ):
        d = config.rotary_dim or config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        scaling = config.rope_scaling or {}
        kind = scaling.get("rope_type", scaling.get("type"))
        # LongRoPE scales q and k by a factor each, so attention logits by its square.
        attention_factor = scaling.get("attention_factor", 1.0)
        if kind == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif kind == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif kind == "longrope":
            context = context or config.max_position_embeddings
            inv_freq = _longrope_inv_freq(inv_freq, scaling, context)
        elif kind not in (None, "default"):
            raise ValueError(
                f"unsupported rope scaling {kind!r}: tinyllm supports llama3, linear, longrope"
            )
        n = config.max_position_embeddings
        freqs = torch.outer(torch.arange(n, dtype=torch.float64), inv_freq)
        self.cos = (freqs.cos() * attention_factor).float().to(device)
        self.sin = (freqs.sin() * attention_factor).float().to(device)


class Attention(nn.Module):
    def __init__(self, c: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.scale = c.head_dim**-0.5
        self.window = c.layer_window(layer)  # its sliding window; None: the whole context
        # q, k and v as one matrix product (fuse_projections stacks Hugging Face's three).
        width = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        self.qkv_proj = nn.Linear(c.hidden_size, width, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: Tensor, positions: Tensor, rope: Rope, ctx: ForwardContext) -> Tensor:
        N, H, KV, D = x.shape[0], self.n_heads, self.n_kv, self.head_dim
        qkv = self.qkv_proj(x)
        q, k, v = qkv.view(N, H + 2 * KV, D).split([H, KV, KV], dim=1)
        if self.q_norm is not None:  # Qwen3: per head, before the rotation
            q.copy_(self.q_norm(q))
            k.copy_(self.k_norm(k))
        layer_ops.rotary(qkv, positions, rope.cos, rope.sin, H + KV, D)
        k_cache, v_cache = ctx.kv_caches[self.layer]
        out = ctx.backend.forward(q, k, v, k_cache, v_cache, ctx.meta, self.scale, self.window)
        return self.o_proj(out.reshape(N, -1))


class MLP(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        # gate and up as one matrix product (fuse_projections stacks them).
        self.gate_up_proj = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(layer_ops.silu_and_mul(self.gate_up_proj(x)))


def _weight(linear: nn.Module) -> Tensor:
    return linear.packed if isinstance(linear, QuantLinear) else linear.weight


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, layer: int):
        super().__init__()
        self.layer, self.config = layer, c
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c, layer)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)
        # forward_fused's arguments after the step's, once loaded: attention's and the MLP's
        self.attention_args: tuple = ()
        self.mlp_args: tuple = ()
        # Sums, in place, a row-parallel projection's (o_proj's, down_proj's) partial output
        # over the tensor-parallel ranks, before its residual add; None (one process holds the
        # whole model): nothing to sum. Set by model/tensor_parallel.apply_tp.
        self.all_reduce: Callable[[Tensor], object] | None = None

    def load_fused_args(self) -> None:
        """The weights as the C++ ops take them, gathered once: at one decode row, walking the
        submodules for them every step is a cost of its own."""
        a, mlp, c = self.self_attn, self.mlp, self.config
        norms = (None, None) if a.q_norm is None else (a.q_norm.weight, a.k_norm.weight)
        eps = c.rms_norm_eps
        weights = [self.input_layernorm.weight, _weight(a.qkv_proj), _weight(a.o_proj)]
        heads = (c.num_heads, c.num_kv_heads)
        self.attention_args = (weights, a.qkv_proj.bias, *norms, *heads, eps, a.scale, a.window)
        weights = [self.post_attention_layernorm.weight, _weight(mlp.gate_up_proj)]
        self.mlp_args = ([*weights, _weight(mlp.down_proj)], c.intermediate_size, eps)

    def forward_fused(
        self, x: Tensor, residual: Tensor | None, positions: Tensor, rope: Rope, ctx
    ) -> tuple[Tensor, Tensor]:
        """`forward` as two C++ ops (model/decoder_layer.cpp), attention and MLP, from the same
        kernels as the CPU attention backend's. Each returns its last projection's output
        before the residual add, where tensor parallelism all-reduces it; the next op, or the
        final norm, does the add, into `residual`'s memory."""
        if residual is None:
            residual, x = x.contiguous(), None
        k_cache, v_cache = ctx.kv_caches[self.layer]
        m = ctx.meta
        o = torch.ops.tinyllm.decoder_attention(
            x, residual, positions, rope.cos, rope.sin, k_cache, v_cache, m.slot_mapping,
            m.block_tables, m.seq_lens, m.query_start_loc, m.num_rows, *self.attention_args,
        )  # fmt: skip
        if self.all_reduce is not None:
            self.all_reduce(o)
        out = torch.ops.tinyllm.decoder_mlp(o, residual, *self.mlp_args)
        if self.all_reduce is not None:
            self.all_reduce(out)
        return out, residual

    def forward(
        self, x: Tensor, residual: Tensor | None, positions: Tensor, rope: Rope, ctx
    ) -> tuple[Tensor, Tensor]:
        """x: the last sublayer's output, not yet added to `residual` (the stream so far; None
        before the first layer). Returns this layer's MLP output and the stream before it."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, rope, ctx)
        if self.all_reduce is not None:
            self.all_reduce(x)
        x, residual = self.post_attention_layernorm(x, residual)
        x = self.mlp(x)
        if self.all_reduce is not None:
            self.all_reduce(x)
        return x, residual


class Backbone(nn.Module):
    """HF's `model.*` submodule: embeddings, layers and the final norm."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c, i) for i in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


# The model's stacked projections, each with Hugging Face's ones it stacks, in order.
STACKED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def fuse_projections(state_dict: dict, num_layers: int) -> dict:
    """Hugging Face's separate q/k/v and gate/up weights (and biases) stacked into the model's
    qkv_proj and gate_up_proj; a state dict that has them stacked already is returned as is."""
    fused = dict(state_dict)
    for i in range(num_layers):
        for own, parts in STACKED.items():
            for kind in ("weight", "bias"):
                names = [f"model.layers.{i}.{part}.{kind}" for part in parts]
                if all(n in fused for n in names):
                    stacked = cat_rows([fused.pop(n) for n in names])
                    fused[f"model.layers.{i}.{own}.{kind}"] = stacked
    return fused


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope: Rope | None = None

    @property
    def dtype(self) -> torch.dtype:
        """The activations' (and K/V's) dtype: the final norm's, which is never quantized."""
        return self.model.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    def load_weights(self, state_dict: dict[str, Tensor], context: int | None = None) -> None:
        """Load HF-named weights; a missing or unexpected tensor is an error, not a warning.
        `context`: the longest sequence it will serve (see Rope)."""
        state_dict = fuse_projections(state_dict, self.config.num_layers)
        # A quantized head (model/quant.py) is already loaded, and ties itself.
        tied = self.config.tie_word_embeddings and isinstance(self.lm_head, nn.Linear)
        if tied:
            state_dict.pop("lm_head.weight", None)
        own = {k for k, _ in self.named_parameters()}
        missing, unexpected = own - state_dict.keys(), state_dict.keys() - own
        if missing or unexpected:
            raise ValueError(
                f"weights do not match the {self.config.architecture} model: "
                f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
            )
        self.load_state_dict(state_dict, strict=False, assign=True)
        if tied:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope = Rope(self.config, self.device, context)
        for layer in self.model.layers:
            layer.load_fused_args()

    @torch.inference_mode()
    def forward(self, input_ids: Tensor, positions: Tensor, ctx: ForwardContext) -> Tensor:
        """input_ids, positions (N,) -> final hidden states (N, hidden); logits are a separate
        step so that only the positions that sample are projected onto the vocabulary."""
        h, residual = self.model.embed_tokens(input_ids), None
        for layer in self.model.layers:
            run = layer.forward_fused if ctx.fused_layers else layer
            h, residual = run(h, residual, positions, self.rope, ctx)
        return self.model.norm(h, residual)[0]

    @torch.inference_mode()
    def logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(hidden).float()
