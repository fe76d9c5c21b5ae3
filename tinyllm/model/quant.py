"""Weight-only quantized linear layers, run by torch's int4 and int8 CPU kernels.

Two formats, each the layout one torch kernel reads, so a weight is never expanded to a dense
matrix (gpt-fast's weight-only handlers are the model):

- int4: groups of 32 weights along the input dimension, w = (q - 8) * scale + zero with q in
  0..15; `torch.ops.aten._weight_int4pack_mm_for_cpu`. This is GGUF's Q4_1 exactly
  (w = q * d + m: scale = d, zero = m + 8d) and Q4_0 (w = (q - 8) * d: zero = 0).
- int8: one scale per output row, w = q * scale with q in -127..127;
  `torch.ops.aten._weight_int8pack_mm`. GGUF's Q8_0 keeps a scale per 32 weights, which this
  kernel cannot take, so Q8_0 is rescaled per row (at most half a step of its own grid off).

Both kernels take activations and scales of one dtype, fp32 or bf16. `quantize_linears`
rewrites a model's nn.Linear layers into these modules in one pass, from dense tensors (Hugging
Face safetensors) or from GGUF's stored groups (`GroupQuantized`).
"""

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from tinyllm.model.precision import QUANTIZATIONS

GROUP = 32


@dataclass
class GroupQuantized:
    """A weight as GGUF stores it: w[n, k] = q[n, k] * scale[n, k // 32] + zero[n, k // 32]."""

    q: Tensor  # (N, K) integers: 0..15 for 4 bits, -127..127 for 8
    scale: Tensor  # (N, K // 32) float32
    zero: Tensor  # (N, K // 32) float32
    bits: int

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def numel(self) -> int:
        return self.q.numel()

    def map_rows(self, fn) -> "GroupQuantized":
        """The same weight with its output rows rearranged by `fn` (a row permutation)."""
        return GroupQuantized(fn(self.q), fn(self.scale), fn(self.zero), self.bits)

    def dequantize(self) -> Tensor:
        n, k = self.q.shape
        w = self.q.view(n, k // GROUP, GROUP).float() * self.scale[..., None]
        return (w + self.zero[..., None]).view(n, k)


def cat_rows(weights: list[Tensor | GroupQuantized]) -> Tensor | GroupQuantized:
    """Weights stacked along their output rows (fused projections); stored groups stay groups
    when every part has the same bits, else all are dequantized."""
    if all(isinstance(w, GroupQuantized) for w in weights) and len({w.bits for w in weights}) == 1:
        return GroupQuantized(
            *(torch.cat([getattr(w, f) for w in weights]) for f in ("q", "scale", "zero")),
            bits=weights[0].bits,
        )
    return torch.cat([_dense(w) for w in weights])


def int4_groups(w: Tensor) -> GroupQuantized:
    """Min-max 4-bit quantization in groups of 32, as llama.cpp's Q4_1: each group's minimum
    and maximum are exact grid points."""
    n, k = w.shape
    g = w.float().view(n, k // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = (hi - lo) / 15
    q = ((g - lo[..., None]) / scale.clamp_min(1e-12)[..., None]).round().clamp(0, 15)
    return GroupQuantized(q.to(torch.uint8).view(n, k), scale, lo, bits=4)


class Int4Linear(nn.Module):
    """y = x W^T (+ b) with W in 4-bit groups of 32 (see the module docstring)."""

    def __init__(self, w: GroupQuantized, bias: Tensor | None, dtype: torch.dtype):
        super().__init__()
        self.out_features, self.in_features = w.shape
        self.register_buffer(
            "packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(w.q.to(torch.int32), 1)
        )
        # The kernel's (K // 32, N, 2) table of (scale, zero) for its (q - 8) convention.
        table = torch.stack([w.scale, w.zero + 8 * w.scale], dim=-1).transpose(0, 1)
        self.register_buffer("scales_and_zeros", table.contiguous().to(dtype))
        self.register_buffer("bias", None if bias is None else bias.to(dtype))

    def forward(self, x: Tensor) -> Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scales_and_zeros)
        return y if self.bias is None else y + self.bias


class Int8Linear(nn.Module):
    """y = x W^T (+ b) with W in int8, one scale per output row."""

    def __init__(self, w: Tensor, bias: Tensor | None, dtype: torch.dtype):
        super().__init__()
        self.out_features, self.in_features = w.shape
        # Codes against the scale as the kernel will read it (bf16 rounds it): half a step off.
        scale = (w.float().abs().amax(dim=1).clamp_min(1e-12) / 127).to(dtype)
        q = (w.float() / scale.float()[:, None]).round().clamp(-127, 127).to(torch.int8)
        self.register_buffer("weight", q)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", None if bias is None else bias.to(dtype))

    def forward(self, x: Tensor) -> Tensor:
        y = torch.ops.aten._weight_int8pack_mm(x, self.weight, self.scale)
        return y if self.bias is None else y + self.bias


class Int8Embedding(nn.Module):
    """Token embeddings read from a tied Int8Linear head's rows: one int8 copy serves both."""

    def __init__(self, head: Int8Linear):
        super().__init__()
        self.head = [head]  # a list, so the head's buffers are not registered twice

    def forward(self, ids: Tensor) -> Tensor:
        head = self.head[0]
        return head.weight[ids].to(head.scale.dtype) * head.scale[ids, None]


def _dense(w: Tensor | GroupQuantized) -> Tensor:
    return w.dequantize() if isinstance(w, GroupQuantized) else w


def _make(kind: str, w: Tensor | GroupQuantized, bias, dtype) -> nn.Module:
    if kind == "int4" and w.shape[1] % GROUP == 0:
        if not (isinstance(w, GroupQuantized) and w.bits == 4):
            w = int4_groups(_dense(w))
        return Int4Linear(w, bias, dtype)
    return Int8Linear(_dense(w), bias, dtype)


def quantize_linears(
    model: nn.Module, state_dict: dict[str, Tensor | GroupQuantized], mode: str, dtype
) -> dict[str, Tensor]:
    """Replace `model`'s nn.Linear layers by quantized ones built from `state_dict`'s weights,
    and return what is left of the state dict, dense, for the model's own load.

    mode "int4": the decoder layers' linears in 4 bits; the LM head in 8, as llama.cpp's
    quantizers keep the output layer at 6-8 bits. mode "int8": every linear in 8 bits. A tied
    LM head's int8 rows also serve as the token embeddings.
    """
    if mode not in QUANTIZATIONS:
        raise ValueError(f"quantization={mode!r}: choose one of {', '.join(QUANTIZATIONS)}")
    state_dict = dict(state_dict)
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    if mode != "none":
        if tied:
            state_dict.setdefault("lm_head.weight", state_dict.pop("model.embed_tokens.weight"))
        for name, module in list(model.named_modules()):
            if not isinstance(module, nn.Linear):
                continue
            kind = "int8" if name == "lm_head" else mode
            new = _make(
                kind, state_dict.pop(f"{name}.weight"), state_dict.pop(f"{name}.bias", None), dtype
            )
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, new)
        if tied:
            model.model.embed_tokens = Int8Embedding(model.lm_head)
    return {k: _dense(v).to(dtype) for k, v in state_dict.items()}


def describe_weights(model: nn.Module) -> str:
    """How a model's linear layers run, e.g. "int4 weights, bfloat16 activations"."""
    kinds = {type(m) for m in model.modules()}
    quant = "int4" if Int4Linear in kinds else "int8" if Int8Linear in kinds else "dense"
    return f"{quant} weights, {str(model.dtype).removeprefix('torch.')} activations"
