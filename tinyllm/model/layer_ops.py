"""A decoder layer's element-wise steps: RMSNorm (with the residual add before it), rotary
embedding, and SiLU- or tanh-GELU-and-multiply (SwiGLU's and Gemma's GeGLU's activations);
and a mixture-of-experts layer's experts (moe_experts).

On the CPU each is one C++ op (layer_ops.cpp) where tinyllm's CPU library builds; elsewhere, and
as the tests' oracle, the same steps in torch. Both compute in fp32 and give the tensor's dtype.
"""

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from tinyllm.model.cpu_library import library_error
from tinyllm.model.quant import GROUP, TILE

NATIVE_DTYPES = (torch.float32, torch.bfloat16)


def native(x: Tensor) -> bool:
    """Whether the C++ ops take x (and the tensors that go with it, of its device and dtype):
    on the CPU, fp32 or bf16, and the library built. Called per op and layer: kept cheap."""
    return x.is_cpu and x.dtype in NATIVE_DTYPES and library_error() is None


def rms_norm(
    x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None
) -> Tensor | tuple[Tensor, Tensor]:
    """RMSNorm(x) * weight. With `residual`: h = x + residual, then (RMSNorm(h) * weight, h);
    the C++ op writes h into `residual`'s memory."""
    contiguous = x.is_contiguous() and (residual is None or residual.is_contiguous())
    if native(x) and weight.dtype == x.dtype and contiguous:
        out = torch.empty_like(x)
        torch.ops.tinyllm.rms_norm(out, x, residual, weight, eps)
        return out if residual is None else (out, residual)
    return rms_norm_torch(x, weight, eps, residual)


def rms_norm_torch(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None):
    if residual is not None:
        x = residual = x + residual
    xf = x.float()
    # Normalised in fp32, rounded, then scaled: Hugging Face's order.
    out = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return out if residual is None else (out, residual)


def rotary(qkv: Tensor, positions: Tensor, cos: Tensor, sin: Tensor, heads: int, head_dim: int):
    """Rotate, in place, the first `heads` heads of each token's row of `qkv` (N, width) by its
    position, in Hugging Face's rotate-half layout over each head's first R dims. cos, sin:
    (max positions, R / 2), fp32; R is head_dim but for partial rotary (Phi-4-mini)."""
    if native(qkv) and qkv.stride(-1) == 1:
        torch.ops.tinyllm.rotary(qkv, positions, cos, sin, heads, head_dim)
    else:
        rotary_torch(qkv, positions, cos, sin, heads, head_dim)


def rotary_torch(qkv, positions, cos, sin, heads, head_dim):
    x = qkv[:, : heads * head_dim].view(len(qkv), heads, head_dim)[..., : 2 * cos.shape[1]]
    c, s = cos[positions][:, None], sin[positions][:, None]
    a, b = x.float().chunk(2, dim=-1)
    x.copy_(torch.cat([a * c - b * s, b * c + a * s], dim=-1))


def _gated(x: Tensor, op: str, torch_twin) -> Tensor:
    """act(gate) * up for x = [gate | up] (N, 2F), the fused gate and up projections: the C++
    op `op` where it runs, else its torch twin."""
    if native(x) and x.is_contiguous():
        out = x.new_empty(*x.shape[:-1], x.shape[-1] // 2)
        getattr(torch.ops.tinyllm, op)(out, x)
        return out
    return torch_twin(x)


def silu_and_mul(x: Tensor) -> Tensor:
    """silu(gate) * up: the gated MLP's SwiGLU."""
    return _gated(x, "silu_and_mul", silu_and_mul_torch)


def silu_and_mul_torch(x: Tensor) -> Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(x: Tensor) -> Tensor:
    """gelu_tanh(gate) * up for x = [gate | up] (N, 2F): Gemma's GeGLU, GELU's tanh approximation
    (transformers' gelu_pytorch_tanh)."""
    return _gated(x, "gelu_tanh_and_mul", gelu_tanh_and_mul_torch)


def gelu_tanh_and_mul_torch(x: Tensor) -> Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


@functools.cache
def has_op(name: str) -> bool:
    """Whether tinyllm's CPU library is loaded and registers torch.ops.tinyllm.`name` (an op a
    newer build adds; looked up once per process)."""
    return library_error() is None and hasattr(torch.ops.tinyllm, name)


def clamped_swiglu_torch(x: Tensor, alpha: float, limit: float) -> Tensor:
    """gpt-oss's experts' activation of x = [gate | up] (N, 2F), in fp32: g = min(gate, limit),
    (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)."""
    gate, up = x.float().chunk(2, dim=-1)
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return ((up + 1) * (gate * torch.sigmoid(alpha * gate))).to(x.dtype)


def moe_experts(
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    gate_up: list[Tensor],
    down: list[Tensor],
    intermediate: int,
    gate_up_bias: Tensor | None = None,
    down_bias: Tensor | None = None,
    swiglu_limit: float | None = None,
    swiglu_alpha: float = 1.702,
) -> Tensor:
    """A mixture-of-experts layer's output for x (N, hidden): for each token t, the sum over
    j = 0..k-1 (in that order, in fp32) of topk_weights[t, j] times expert topk_ids[t, j]'s
    SwiGLU MLP on x[t], rounded once to x's dtype. gate_up[e], down[e]: expert e's weights as
    layers.op_weight gives them (dense, or QuantLinear's packed records); `intermediate`: an
    expert's FFN width. Each chosen expert runs once over the rows that chose it. gpt-oss: the
    experts' biases (gate_up_bias, down_bias: a row per expert) and, with swiglu_limit, the
    clamped SwiGLU (clamped_swiglu_torch) in place of SiLU(gate) * up."""
    args = (x, topk_ids, topk_weights, gate_up, down, intermediate, gate_up_bias, down_bias)
    if native(x) and x.is_contiguous() and has_op("moe_experts"):
        return torch.ops.tinyllm.moe_experts(*args, swiglu_limit, swiglu_alpha)
    return moe_experts_torch(*args, swiglu_limit, swiglu_alpha)


def _expert_linear(x: Tensor, w: Tensor, n: int) -> Tensor:
    """x W^T for an expert's weight: dense, or packed records (model/quant.py's pack, whose
    record holds TILE rows of GROUP codes at `bits` bits and their fp16 scales and offsets)."""
    if w.dtype != torch.uint8:
        return F.linear(x, w)
    bits = (w.shape[-1] - 4 * TILE) * 8 // (TILE * GROUP)
    return torch.ops.tinyllm.quant_linear(x, w, n, bits)


def moe_experts_torch(
    x,
    topk_ids,
    topk_weights,
    gate_up,
    down,
    intermediate,
    gate_up_bias=None,
    down_bias=None,
    swiglu_limit=None,
    swiglu_alpha=1.702,
):
    n, k = topk_ids.shape
    hidden = x.shape[1]
    # Each (token, choice)'s weighted expert output, summed over the choices in order below.
    parts = torch.zeros(n * k, hidden, dtype=torch.float32, device=x.device)
    choices, weights = topk_ids.flatten(), topk_weights.flatten().float()
    for e in choices.unique().tolist():
        slots = (choices == e).nonzero().squeeze(1)
        rows = x[slots // k].contiguous()
        h = _expert_linear(rows, gate_up[e], 2 * intermediate)
        h = h if gate_up_bias is None else h + gate_up_bias[e]
        if swiglu_limit is None:
            act = silu_and_mul(h)
        else:
            act = clamped_swiglu_torch(h, swiglu_alpha, swiglu_limit)
        out = _expert_linear(act, down[e], hidden)
        out = out if down_bias is None else out + down_bias[e]
        parts[slots] = out.float() * weights[slots, None]
    parts = parts.view(n, k, hidden)
    total = parts[:, 0].clone()
    for j in range(1, k):
        total += parts[:, j]
    return total.to(x.dtype)
