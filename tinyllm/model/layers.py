"""The layers every decoder family shares: RMSNorm, rotary embedding tables (with Llama 3.1's
and Phi-3's scalings), attention over the paged K/V cache, the gated MLP, and the stacking of
Hugging Face's q/k/v and gate/up weights into one matrix product each. A family's file (llama.py)
composes them into its decoder layer. Their attribute names are Hugging Face's (the stacked
qkv_proj and gate_up_proj are vLLM's), so a state dict key such as
`model.layers.0.self_attn.qkv_proj.weight` names the same tensor in every loader, in
tensor-parallel sharding and in quantization.
"""

import math

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


def _yarn(inv_freq: Tensor, scaling: dict, dim: int, theta: float) -> tuple[Tensor, float]:
    """YaRN (gpt-oss): frequencies that turn fewer than beta_slow times over the pretrained
    context divided by `factor`, those turning more than beta_fast times kept, a linear ramp
    between; and its attention factor on cos and sin (0.1 ln(factor) + 1), as transformers'
    _compute_yarn_parameters."""
    factor, old_ctx = scaling["factor"], scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high += 0.001 if low == high else 0  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    inv_freq = inv_freq / factor * ramp + inv_freq * (1 - ramp)
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")

        def get_mscale(m: float = 1.0) -> float:
            return 0.1 * m * math.log(factor) + 1.0 if factor > 1 else 1.0

        both = mscale and mscale_all
        attention_factor = get_mscale(mscale) / get_mscale(mscale_all) if both else get_mscale()
    return inv_freq, attention_factor


class Rope:
    """Rotary embedding tables: cos and sin of each position's angles, (positions, rotary dims /
    2) in fp32, for layer_ops.rotary; LongRoPE and YaRN scale both by their attention factor.
    `context`: the longest sequence served (max_model_len; None: the model's context), which
    picks LongRoPE's factors. `local`: the sliding layers'
    own tables (Gemma 3): config.rope_local_theta's base, unscaled."""

    def __init__(
        self,
        config: ModelConfig,
        device: torch.device | str = "cpu",
        context: int | None = None,
        local: bool = False,
    ):
        d = config.rotary_dim or config.head_dim
        theta = config.rope_local_theta if local else config.rope_theta
        inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        scaling = {} if local else config.rope_scaling or {}
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
        elif kind == "yarn":
            inv_freq, attention_factor = _yarn(inv_freq, scaling, d, theta)
        elif kind not in (None, "default"):
            raise ValueError(
                f"unsupported rope scaling {kind!r}: tinyllm supports llama3, linear, longrope, "
                "yarn"
            )
        n = config.max_position_embeddings
        freqs = torch.outer(torch.arange(n, dtype=torch.float64), inv_freq)
        self.cos = (freqs.cos() * attention_factor).float().to(device)
        self.sin = (freqs.sin() * attention_factor).float().to(device)


class Attention(nn.Module):
    """Self-attention of layer `layer`: qkv_proj, Qwen3's (and Gemma 3's) per-head q/k norms where
    the config has them, rotary, the backend's attention over the layer's paged K/V cache (Gemma
    2's scores soft-capped, gpt-oss's sinks in the softmax), o_proj."""

    def __init__(self, c: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.scale = (c.query_pre_attn_scalar or c.head_dim) ** -0.5
        self.softcap = c.attn_logit_softcapping
        self.window = c.layer_window(layer)  # its sliding window; None: the whole context
        # q, k and v as one matrix product (fuse_projections stacks Hugging Face's three).
        width = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        self.qkv_proj = nn.Linear(c.hidden_size, width, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=c.o_proj_bias)
        # gpt-oss's sinks: a logit per query head in the softmax's denominator (HF's name).
        self.sinks = nn.Parameter(torch.zeros(c.num_heads)) if c.attention_sinks else None
        if c.qk_norm:  # per head (Qwen3), or over all heads' width (OLMoE)
            q_width = k_width = c.head_dim
            if c.qk_norm_all_heads:
                q_width, k_width = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
            self.q_norm = RMSNorm(q_width, c.rms_norm_eps)
            self.k_norm = RMSNorm(k_width, c.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: Tensor, positions: Tensor, rope: Rope, ctx: ForwardContext) -> Tensor:
        N, H, KV, D = x.shape[0], self.n_heads, self.n_kv, self.head_dim
        qkv = self.qkv_proj(x)
        q, k, v = qkv.view(N, H + 2 * KV, D).split([H, KV, KV], dim=1)
        if self.q_norm is not None:  # before the rotation; per head, or over q's whole row
            # Rows of the norm's width, contiguous: the kernel's per-row order, whatever N is.
            for x, norm in ((q, self.q_norm), (k, self.k_norm)):
                x.copy_(norm(x.reshape(-1, norm.weight.numel()).contiguous()).view_as(x))
        layer_ops.rotary(qkv, positions, rope.cos, rope.sin, H + KV, D)
        k_cache, v_cache = ctx.kv_caches[self.layer]
        out = ctx.backend.forward(
            q, k, v, k_cache, v_cache, ctx.meta, self.scale, self.window, self.softcap, self.sinks
        )
        return self.o_proj(out.reshape(N, -1))


class MLP(nn.Module):
    """The gated MLP: down_proj(act(gate_proj(x)) * up_proj(x)), gate and up as one product; act
    is SiLU (SwiGLU) or GELU's tanh approximation (Gemma's GeGLU)."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        gelu = c.hidden_act == "gelu_pytorch_tanh"
        self.act_and_mul = layer_ops.gelu_tanh_and_mul if gelu else layer_ops.silu_and_mul
        # gate and up as one matrix product (fuse_projections stacks them).
        self.gate_up_proj = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))


def op_weight(linear: nn.Module) -> Tensor:
    """A projection's weight as the C++ ops take it: dense, or QuantLinear's packed records."""
    return linear.packed if isinstance(linear, QuantLinear) else linear.weight


# The model's stacked projections, each with Hugging Face's ones it stacks, in order.
STACKED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


# A mixture-of-experts layer's experts (model/moe.py): each stacks its gate and up as the MLP.
EXPERT_STACKED = ("gate_up_proj", ("gate_proj", "up_proj"))


def expert_prefix(name: str) -> str | None:
    """`model.layers.N.mlp.experts.E.` for a name under an expert, else None."""
    head, sep, rest = name.partition(".mlp.experts.")
    expert = rest.partition(".")[0]
    return f"{head}{sep}{expert}." if sep and expert.isdigit() else None


def fuse_projections(state_dict: dict, num_layers: int) -> dict:
    """Hugging Face's separate q/k/v and gate/up weights (and biases) stacked into the model's
    qkv_proj and gate_up_proj, the experts' gate/up too; a state dict that has them stacked
    already is returned as is."""
    fused = dict(state_dict)
    stacks = [
        (f"model.layers.{i}.{own}", [f"model.layers.{i}.{part}" for part in parts])
        for i in range(num_layers)
        for own, parts in STACKED.items()
    ]
    own, parts = EXPERT_STACKED
    experts = {expert_prefix(name) for name in state_dict} - {None}
    stacks += [(p + own, [p + part for part in parts]) for p in sorted(experts)]
    for own, parts in stacks:
        for kind in ("weight", "bias"):
            names = [f"{part}.{kind}" for part in parts]
            if all(n in fused for n in names):
                fused[f"{own}.{kind}"] = cat_rows([fused.pop(n) for n in names])
    return fused


def assign_weights(model: nn.Module, state_dict: dict[str, Tensor]) -> None:
    """`state_dict`'s tensors as `model`'s parameters (assigned, not copied), every one by name:
    a missing or unexpected tensor is an error, not a warning."""
    own = {k for k, _ in model.named_parameters()}
    missing, unexpected = own - state_dict.keys(), state_dict.keys() - own
    if missing or unexpected:
        raise ValueError(
            f"weights do not match the {model.config.architecture} model: "
            f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    model.load_state_dict(state_dict, strict=False, assign=True)
    # Inference only: with no weight asking for gradients, autograd records nothing, even
    # where the caller's thread has grad mode on outside the model's inference_mode.
    model.requires_grad_(False)
