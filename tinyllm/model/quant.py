"""Weight-only quantized linear layers: weights in blocks of 32 at 4 or 8 bits, run by tinyllm's
C++ kernel (quant_linear.cpp) on int8-quantized activations, as llama.cpp runs GGUF files.

One format for both widths: per block of 32 weights of a row, w = d * u + m with unsigned codes
u (0..15 at 4 bits, 1..255 at 8) and an fp16 scale d and offset m. GGUF's Q4_1 is this exactly
(u = q, m as stored), Q4_0 too (m = -8d) and Q8_0 (u = q + 128, m = -128d); loaders/gguf_blocks.py
maps the other types onto it. A GGUF file's blocks are packed from their bytes, never expanded
to a dense matrix; other weights (Hugging Face safetensors, GGUF types with sub-blocks of 16)
are quantized here at load. `quantize_linears` rewrites a model's nn.Linear layers into
`QuantLinear` in one pass (gpt-fast's weight-only handlers are the model). `pack` lays the
blocks out as the kernel reads them; `unpack` is its inverse, used by the tied embeddings and
the tests.
"""

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from tinyllm.model.cpu_library import library_error
from tinyllm.model.precision import QUANTIZATIONS

GROUP = 32  # weights per scale
TILE = 16  # output rows the kernel computes together, one per vector lane
# Linears quantize_linears leaves dense: a mixture-of-experts router (model/moe.py), whose few
# rows choose the experts; rounding them would change which.
DENSE_LINEARS = (".mlp.gate",)


@dataclass
class GroupQuantized:
    """A weight in blocks: w[n, k] = q[n, k] * scale[n, k // 32] + zero[n, k // 32]."""

    q: Tensor  # (N, K) uint8 codes: 0..15 for 4 bits, 1..255 for 8 (see pack)
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

    def columns(self, cols: slice) -> "GroupQuantized":
        """The weight's input columns `cols` (a step-1 slice starting and stopping on group
        boundaries): whole groups, with their scales, copied out contiguous as pack needs."""
        k = range(self.q.shape[1])[cols]
        if len(k) == self.q.shape[1]:
            return self
        groups = slice(k.start // GROUP, k.stop // GROUP)
        return GroupQuantized(
            self.q[:, k.start : k.stop].contiguous(),
            self.scale[:, groups].contiguous(),
            self.zero[:, groups].contiguous(),
            self.bits,
        )

    def widened(self) -> "GroupQuantized":
        """4-bit groups as 8-bit ones: u + 1 and m - d, exact up to the fp16 rounding of m - d
        (the 1 keeps codes off 0, see pack)."""
        if self.bits == 8:
            return self
        return GroupQuantized(self.q + 1, self.scale, self.zero - self.scale, bits=8)

    def dequantize(self) -> Tensor:
        n, k = self.q.shape
        w = self.q.view(n, k // GROUP, GROUP).float() * self.scale[..., None]
        return (w + self.zero[..., None]).view(n, k)


def cat_rows(weights: list[Tensor | GroupQuantized]) -> Tensor | GroupQuantized:
    """Weights stacked along their output rows (fused projections); stored groups stay groups,
    4-bit parts widened to 8 bits if another part is 8-bit (a Q4_K_M file's Q6_K v_proj beside
    Q4_K q and k), else all are dequantized."""
    if all(isinstance(w, GroupQuantized) for w in weights):
        if len({w.bits for w in weights}) > 1:
            weights = [w.widened() for w in weights]
        return GroupQuantized(
            *(torch.cat([getattr(w, f) for w in weights]) for f in ("q", "scale", "zero")),
            bits=weights[0].bits,
        )
    return torch.cat([_dense(w) for w in weights])


def _fp16(t: Tensor) -> Tensor:
    """Values as the packed format stores them (fp16), so codes are chosen against those."""
    return t.half().float()


def _groups_of(w: Tensor) -> Tensor:
    """(N, K) as (N, K / 32, 32), K zero-padded to whole groups."""
    n, k = w.shape
    w = nn.functional.pad(w.float(), (0, -k % GROUP))
    return w.view(n, -1, GROUP)


def int4_groups(w: Tensor) -> GroupQuantized:
    """Min-max 4-bit quantization in groups of 32, as llama.cpp's Q4_1."""
    g = _groups_of(w)
    lo, hi = _fp16(g.amin(-1)), g.amax(-1)
    scale = _fp16((hi - lo) / 15)
    q = ((g - lo[..., None]) / scale.clamp_min(1e-12)[..., None]).round().clamp(0, 15)
    return GroupQuantized(q.to(torch.uint8).flatten(1), scale, lo, bits=4)


def int8_groups(w: Tensor) -> GroupQuantized:
    """Symmetric 8-bit quantization in groups of 32, as llama.cpp's Q8_0 (u = q + 128)."""
    g = _groups_of(w)
    scale = _fp16(g.abs().amax(-1) / 127)
    q = (g / scale.clamp_min(1e-12)[..., None]).round().clamp(-127, 127) + 128
    return GroupQuantized(q.to(torch.uint8).flatten(1), scale, -128 * scale, bits=8)


def pack(w: GroupQuantized) -> Tensor:
    """The kernel's layout (quant_linear.cpp): (N / 16 tiles, K / 32 blocks, record) uint8,
    each record the codes of 16 rows x 32 weights, then their 16 fp16 d and 16 fp16 m.

    8-bit codes must not be 0: without VNNI the kernel multiplies u - 128 by the sign of each
    activation code, and -128 has no positive counterpart in int8."""
    u = w.q.to(torch.uint8)
    if w.bits == 8 and u.numel() and u.min() == 0:
        raise ValueError("8-bit codes must be in 1..255, got a 0 (see model/quant.py pack)")
    pad = -len(u) % TILE  # zero rows, whose outputs are never written
    d, m = w.scale, w.zero
    if pad:
        u, d, m = (nn.functional.pad(t, (0, 0, 0, pad)) for t in (u, d, m))
    tiles, blocks = len(u) // TILE, d.shape[1]
    n_code = TILE * GROUP * w.bits // 8
    # Written in place, field by field: no intermediate copy of the codes.
    out = torch.empty(tiles, blocks, n_code + 4 * TILE, dtype=torch.uint8)
    if w.bits == 4:
        # codes (tile, block, chunk, row, j): weights 8 * chunk + j (low nibble), + 4 (high)
        codes = out[..., :n_code].view(tiles, blocks, 4, TILE, 4).permute(0, 3, 1, 2, 4)
        c = u.view(tiles, TILE, blocks, 4, 2, 4)
        codes.copy_(c[..., 1, :])
        codes <<= 4
        codes |= c[..., 0, :]
    else:
        codes = out[..., :n_code].view(tiles, blocks, 8, TILE, 4).permute(0, 3, 1, 2, 4)
        codes.copy_(u.view(tiles, TILE, blocks, 8, 4))
    scales = out[..., n_code:].view(torch.float16).view(tiles, blocks, 2, TILE)
    for i, t in enumerate((d, m)):
        scales[:, :, i].copy_(t.view(tiles, TILE, blocks).transpose(1, 2))
    return out


def unpack(packed: Tensor, bits: int, rows: Tensor | None = None) -> Tensor:
    """The dense fp32 weight (tiles * 16, blocks * 32) of `packed`, or only its output `rows`
    (len(rows), blocks * 32): the embeddings read a few rows of the LM head per step."""
    tiles, blocks, _ = packed.shape
    if rows is None:
        rows = torch.arange(tiles * TILE, device=packed.device)
    picked, lanes = packed[rows // TILE], rows % TILE  # each row's tile, and its lane there
    everyone = torch.arange(len(rows), device=packed.device)
    n_code = TILE * GROUP * bits // 8
    # Codes by (chunk, lane, j): each row's bytes are the 4 at 4 * lane of every 64-byte chunk.
    codes = picked[..., :n_code].view(len(rows), blocks, -1, TILE, 4)[everyone, ..., lanes, :]
    codes = codes.to(torch.int32)  # (row, block, chunk, j)
    if bits == 4:  # chunk c's byte j: weights 8c + j (low nibble) and 8c + 4 + j (high)
        codes = torch.stack([codes & 0x0F, codes >> 4], dim=-2)  # (row, block, chunk, nibble, j)
    u = codes.reshape(len(rows), blocks, GROUP).float()
    scales = picked[..., n_code:].contiguous().view(torch.float16).float()
    d, m = scales.view(len(rows), blocks, 2, TILE)[everyone, ..., lanes].unbind(-1)
    return (u * d[..., None] + m[..., None]).flatten(1)


class QuantLinear(nn.Module):
    """y = x W^T (+ b) with W in 4- or 8-bit blocks of 32 (see the module docstring)."""

    def __init__(
        self, w: GroupQuantized, bias: Tensor | None, dtype: torch.dtype, in_features: int
    ):
        super().__init__()
        if error := library_error():
            raise RuntimeError(f"quantized weights need tinyllm's CPU kernels: {error}")
        self.out_features, self.in_features = len(w.q), in_features  # w's K: whole groups
        self.bits = w.bits
        self.register_buffer("packed", pack(w))
        self.register_buffer("bias", None if bias is None else bias.to(dtype))

    def forward(self, x: Tensor) -> Tensor:
        y = torch.ops.tinyllm.quant_linear(
            x.contiguous(), self.packed, self.out_features, self.bits
        )
        return y if self.bias is None else y + self.bias


class QuantEmbedding(nn.Module):
    """Token embeddings read from a tied QuantLinear head's rows: one copy serves both."""

    def __init__(self, head: QuantLinear, dtype: torch.dtype):
        super().__init__()
        self.head = [head]  # a list, so the head's buffers are not registered twice
        self.dtype = dtype

    def forward(self, ids: Tensor) -> Tensor:
        head = self.head[0]
        rows = unpack(head.packed, head.bits, ids.flatten())
        return rows[:, : head.in_features].to(self.dtype).view(*ids.shape, -1)


def _dense(w: Tensor | GroupQuantized) -> Tensor:
    return w.dequantize() if isinstance(w, GroupQuantized) else w


def _make(bits: int, w: Tensor | GroupQuantized, bias, dtype, keep_stored: bool) -> QuantLinear:
    """Stored groups run as they are, widened (exactly) where `bits` is more; they are rounded
    again only to fewer bits, and not at all with `keep_stored`."""
    k = w.shape[1]
    if isinstance(w, GroupQuantized) and (w.bits <= bits or keep_stored):
        w = w.widened() if w.bits < bits else w
    else:
        w = (int4_groups if bits == 4 else int8_groups)(_dense(w))
    return QuantLinear(w, bias, dtype, in_features=k)


def quantize_linears(
    model: nn.Module,
    state_dict: dict[str, Tensor | GroupQuantized],
    mode: str,
    dtype: torch.dtype,
    keep_stored: bool = False,
) -> dict[str, Tensor]:
    """Replace `model`'s nn.Linear layers by quantized ones built from `state_dict`'s weights,
    and return what is left of the state dict, dense, for the model's own load. `state_dict` is
    consumed: each weight leaves it as its layer is built, so that a load holds one layer's
    unpacked codes beside the packed model, not every layer's (pass a copy to keep it).

    mode "int4": the decoder layers' linears in 4 bits; the LM head in 8, as llama.cpp's
    quantizers keep the output layer at 6-8 bits. mode "int8": every linear in 8 bits. MoE
    routers stay dense in both (DENSE_LINEARS). A tied
    LM head's rows also serve as the token embeddings. With `keep_stored` (quantization "auto"
    on a GGUF file), weights the file stores at 5-8 bits stay 8-bit in "int4": a Q4_K_M file's
    Q5_0 and Q6_K tensors, rounded again to 4 bits, change its greedy answers.
    """
    if mode not in QUANTIZATIONS:
        raise ValueError(f"quantization={mode!r}: choose one of {', '.join(QUANTIZATIONS)}")
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    if mode != "none":
        if tied:
            state_dict.setdefault("lm_head.weight", state_dict.pop("model.embed_tokens.weight"))
        for name, module in list(model.named_modules()):
            if not isinstance(module, nn.Linear) or name.endswith(DENSE_LINEARS):
                continue
            bits = 8 if name == "lm_head" or mode == "int8" else 4
            w, bias = state_dict.pop(f"{name}.weight"), state_dict.pop(f"{name}.bias", None)
            new = _make(bits, w, bias, dtype, keep_stored)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, new)
        if tied:
            model.model.embed_tokens = QuantEmbedding(model.lm_head, dtype)
    return {k: _dense(v).to(dtype) for k, v in state_dict.items()}


def describe_weights(model: nn.Module) -> str:
    """How a model's linear layers run, e.g. "int4 weights, bfloat16 activations"."""
    bits = {m.bits for m in model.modules() if isinstance(m, QuantLinear)}
    quant = f"int{min(bits)}" if bits else "dense"
    return f"{quant} weights, {str(model.dtype).removeprefix('torch.')} activations"
