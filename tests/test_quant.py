"""Quantized linear layers (model/quant.py) against dequantize-then-matmul, and GGUF's stored
groups (loaders/gguf.py) against the gguf library's own dequantization."""

import gguf
import numpy as np
import pytest
import torch
from torch import nn

from tinyllm.loaders.gguf import _groups
from tinyllm.model import precision
from tinyllm.model.config import ModelConfig
from tinyllm.model.llama import Transformer
from tinyllm.model.precision import resolve_dtype, resolve_quantization
from tinyllm.model.quant import (
    GroupQuantized,
    Int4Linear,
    Int8Embedding,
    Int8Linear,
    int4_groups,
    quantize_linears,
)

Q = gguf.GGMLQuantizationType


def random_groups(n: int, k: int, gen: torch.Generator) -> GroupQuantized:
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scale = torch.rand(n, k // 32, generator=gen) * 0.02 + 1e-3
    zero = -8 * scale + torch.randn(n, k // 32, generator=gen) * 0.01
    return GroupQuantized(q, scale, zero, bits=4)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_gguf_groups_are_the_stored_weights(qtype):
    """The groups read from a tensor's blocks dequantize to what the gguf library reads."""
    w = np.random.default_rng(0).standard_normal((24, 96)).astype(np.float32)
    blocks = gguf.quants.quantize(w, qtype)
    groups = _groups(blocks, qtype, w.shape)
    assert groups.bits == (8 if qtype == Q.Q8_0 else 4)
    expected = torch.from_numpy(gguf.quants.dequantize(blocks, qtype).astype(np.float32))
    torch.testing.assert_close(groups.dequantize(), expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_int4_linear_fp32_is_dequantize_then_matmul(rows):
    gen = torch.Generator().manual_seed(rows)
    w = random_groups(96, 128, gen)
    bias = torch.randn(96, generator=gen)
    x = torch.randn(rows, 128, generator=gen)
    layer = Int4Linear(w, bias, torch.float32)
    expected = x @ w.dequantize().T + bias
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)


def test_int4_linear_bf16_is_close_to_fp32():
    gen = torch.Generator().manual_seed(1)
    w = random_groups(64, 256, gen)
    x = torch.randn(5, 256, generator=gen)
    y = Int4Linear(w, None, torch.bfloat16)(x.bfloat16())
    assert y.dtype == torch.bfloat16
    expected = x @ w.dequantize().T
    # bf16 keeps 8 bits of mantissa: a few parts in a thousand of the output's scale.
    assert (y.float() - expected).abs().max() < 1e-2 * expected.abs().max()


def test_int4_groups_keep_weights_already_on_a_4bit_grid():
    """Min-max quantization recovers a Q4_1-style weight whose groups span their whole grid."""
    gen = torch.Generator().manual_seed(2)
    w = random_groups(8, 64, gen)
    w.q[:, ::32], w.q[:, 1::32] = 0, 15  # every group reaches both ends of its grid
    again = int4_groups(w.dequantize())
    torch.testing.assert_close(again.dequantize(), w.dequantize(), rtol=0, atol=1e-6)


def test_int4_groups_error_is_at_most_half_a_step():
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(3))
    g = int4_groups(w)
    step = g.scale.repeat_interleave(32, dim=1)
    assert ((g.dequantize() - w).abs() <= step / 2 + 1e-6).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_is_its_int8_weight_times_the_row_scale(dtype):
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(48, 80, generator=gen)
    x = torch.randn(6, 80, generator=gen).to(dtype)
    layer = Int8Linear(w, None, dtype)
    dequantized = layer.weight.float() * layer.scale.float()[:, None]
    # Per-row absmax scaling: within half a step of the original.
    assert ((dequantized - w).abs() <= layer.scale.float()[:, None] / 2 + 1e-3).all()
    expected = x.float() @ dequantized.T
    tol = 1e-5 if dtype == torch.float32 else 2e-2 * expected.abs().max().item()
    torch.testing.assert_close(layer(x).float(), expected, rtol=1e-4, atol=tol)


def test_quantize_linears_rewrites_every_linear_and_ties_the_embedding():
    torch.manual_seed(6)
    config = ModelConfig("llama", 64, 64, 96, 1, 2, 1, 32, 48, tie_word_embeddings=True)
    dense = Transformer(config)
    dense.load_weights(dict(dense.state_dict()))
    state = dict(dense.state_dict())
    with torch.device("meta"):
        model = Transformer(config)
    rest = quantize_linears(model, state, "int4", torch.float32)
    model.load_weights(rest)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.qkv_proj, Int4Linear) and isinstance(model.lm_head, Int8Linear)
    assert isinstance(model.model.embed_tokens, Int8Embedding)
    ids = torch.tensor([3, 9, 1])
    emb = model.model.embed_tokens(ids)
    rows = model.lm_head.weight[ids].float() * model.lm_head.scale[ids, None]
    torch.testing.assert_close(emb, rows)
    assert (emb - dense.model.embed_tokens(ids)).abs().max() <= model.lm_head.scale.max() / 2


def test_resolve_quantization():
    cpu = torch.device("cpu")
    assert resolve_quantization("auto", {4, 8}, cpu)[0] == "int4"
    assert resolve_quantization("auto", {8}, cpu)[0] == "int8"
    assert resolve_quantization("auto", set(), cpu)[0] == "none"
    assert resolve_quantization("int8", {4}, cpu)[0] == "int8"
    assert resolve_quantization("auto", {4}, torch.device("cuda"))[0] == "none"
    with pytest.raises(ValueError, match="CPU only"):
        resolve_quantization("int4", {4}, torch.device("cuda"))
    with pytest.raises(ValueError, match="choose auto or one of none, int8, int4"):
        resolve_quantization("q4", {4}, cpu)


def test_resolve_dtype(monkeypatch, caplog):
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", torch.device("cuda"), "none")[0] == torch.bfloat16
    assert resolve_dtype("auto", cpu, "int4")[0] == torch.bfloat16
    assert resolve_dtype("float32", cpu, "none") == (torch.float32, "as asked")
    monkeypatch.setattr(precision, "amx", lambda: False)
    assert resolve_dtype("auto", cpu, "none")[0] == torch.float32
    monkeypatch.setattr(precision, "amx", lambda: True)
    assert resolve_dtype("auto", cpu, "none")[0] == torch.bfloat16
    with caplog.at_level("WARNING", logger="tinyllm"):
        assert resolve_dtype("float32", cpu, "int4")[0] == torch.float32
    assert "slow fallback" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="tinyllm"):
        assert resolve_dtype(torch.float32, cpu, "int8") == (torch.float32, "as asked")
    assert "int8 weights with float32 activations" in caplog.text
    with pytest.raises(ValueError, match="choose one of float32, bfloat16, float16 or 'auto'"):
        resolve_dtype("fp8", cpu, "none")
