"""Every C++ op (torch.ops.tinyllm.*) on the shapes at its edges: no rows, no columns, sizes off
its tiles. An op either gives the torch reference's answer (an empty result of the right shape
when there is nothing to compute) or refuses with an error that names the op, the argument and
the shape it got. Before these checks, zero rows in quant_linear divided by zero (SIGFPE: the
process died without a message) and a bad table or length read outside the K/V pool."""

from dataclasses import replace

import pytest
import torch

from tests.test_attention_cpu import REFERENCE, build
from tests.test_decoder_layer import BLOCK, _model
from tests.test_quant import quantized_activations, random_groups
from tinyllm.model import layer_ops
from tinyllm.model.cpu_library import library_error
from tinyllm.model.quant import QuantLinear, pack

pytestmark = pytest.mark.skipif(
    library_error() is not None, reason=f"CPU library did not build: {library_error()}"
)
ops = torch.ops.tinyllm


# quant_linear: tiles of 16 output rows, blocks of 32 inputs.


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(
    "x_shape,n",
    [((0, 70), 40), ((2, 0, 64), 16), ((5, 33), 17)],
    ids=["no-rows", "no-rows-3d", "off-both-tiles"],
)
def test_quant_linear_edges_match_dequantize_then_matmul(bits, x_shape, n):
    """Zero rows is what a step that only runs prompt chunks gave the LM head."""
    k = x_shape[-1]
    gen = torch.Generator().manual_seed(n + k)
    groups = random_groups(n, -(-k // 32) * 32, bits, gen)
    x = torch.randn(x_shape, generator=gen)
    y = QuantLinear(groups, None, torch.float32, in_features=k)(x)
    assert y.shape == (*x_shape[:-1], n) and y.dtype == x.dtype
    rows = quantized_activations(x.reshape(-1, k)).double()
    expected = (rows @ groups.dequantize().double().T).view(y.shape)
    torch.testing.assert_close(y.double(), expected, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("bits", [4, 8])
def test_quant_linear_of_no_outputs_is_empty(bits):
    packed = torch.empty(0, 2, 16 * 32 * bits // 8 + 64, dtype=torch.uint8)
    assert ops.quant_linear(torch.randn(3, 64), packed, 0, bits).shape == (3, 0)


PACKED = pack(random_groups(32, 64, 4, torch.Generator().manual_seed(0)))  # 2 tiles x 2 blocks


@pytest.mark.parametrize(
    "x,packed,n,bits,message",
    [
        (torch.randn(3, 0), PACKED, 32, 4, r"x \[3, 0\] must have a last dim of at least 1"),
        (torch.randn(2, 64), PACKED, 33, 4,
         r"packed weights \[2, 2, 320\] do not fit 33 .* need \[3, 2, 320\]"),
        (torch.randn(2, 64), PACKED[0], 32, 4,
         r"packed weights \[2, 320\] do not fit 32 .* need \[2, 2, 320\]"),
        (torch.randn(2, 64), PACKED, -1, 4, r"n \(output features\) must be >= 0, not -1"),
        (torch.randn(2, 64), PACKED.view(torch.int8), 32, 4, "packed must be Byte, not Char"),
        (torch.randn(64, 2).T, PACKED, 32, 4, r"x \[2, 64\] must be contiguous"),
        (torch.randn(2, 64, device="meta"), PACKED, 32, 4, "x must be on the CPU, not meta"),
        (torch.randn(2, 64), PACKED, 32, 3, "bits must be 4 or 8, not 3"),
    ],
    ids=["no-columns", "n-off-packed", "packed-2d", "negative-n", "int8", "strided", "meta", "3b"],
)  # fmt: skip
def test_quant_linear_refuses(x, packed, n, bits, message):
    with pytest.raises(RuntimeError, match="quant_linear: " + message):
        ops.quant_linear(x, packed, n, bits)


# rms_norm, rotary, silu_and_mul, gelu_tanh_and_mul


@pytest.mark.parametrize("shape", [(0, 64), (3, 0), (0, 0)])
def test_rms_norm_of_nothing_is_empty(shape):
    x, residual = torch.randn(shape), torch.randn(shape)
    weight = torch.randn(shape[-1])
    torch.testing.assert_close(
        layer_ops.rms_norm(x, weight, 1e-6), layer_ops.rms_norm_torch(x, weight, 1e-6)
    )
    out, summed = layer_ops.rms_norm(x, weight, 1e-6, residual)
    assert out.shape == summed.shape == shape


X, W = torch.randn(4, 64), torch.randn(64)


@pytest.mark.parametrize(
    "out,x,residual,weight,message",
    [
        (X, X, None, torch.randn(32), r"weight \[32\] must be \[64\], x's last dim"),
        (X, X, None, torch.randn(4, 64), r"weight \[4, 64\] must be \[64\]"),
        (torch.empty(3, 64), X, None, W, r"out \[3, 64\] must be x's \[4, 64\]"),
        (X, X, torch.randn(2, 64), W, r"residual \[2, 64\] must be x's \[4, 64\]"),
        (X, X, None, W.double(), "weight must be Float, not Double"),
        (torch.empty(()), torch.randn(()), None, W, r"x must have at least 1 dim, not \[\]"),
        (X, torch.randn(64, 4).T, None, W, r"x \[4, 64\] must be contiguous"),
    ],
    ids=["short-weight", "2d-weight", "out", "residual", "weight-dtype", "scalar", "strided"],
)
def test_rms_norm_refuses(out, x, residual, weight, message):
    with pytest.raises(RuntimeError, match="rms_norm: " + message):
        ops.rms_norm(out, x, residual, weight, 1e-6)


COS = SIN = torch.zeros(10, 4)  # head_dim 8


def test_rotary_of_no_rows_is_nothing():
    qkv = torch.empty(0, 32)
    ops.rotary(qkv, torch.empty(0, dtype=torch.long), COS, SIN, 2, 8)
    assert qkv.shape == (0, 32)


@pytest.mark.parametrize(
    "qkv,positions,sin,heads,head_dim,message",
    [
        (torch.zeros(3, 32), torch.zeros(2, dtype=torch.long), SIN, 2, 8,
         r"positions \[2\] must be \[3\], one per row of qkv"),
        (torch.zeros(3, 32), torch.zeros(3, dtype=torch.long), SIN, 5, 8,
         "5 heads of 8 do not fit in qkv's rows of 32"),
        (torch.zeros(3, 32), torch.zeros(3, dtype=torch.long), SIN, 2, 7,
         "head_dim must be even, not 7"),
        (torch.zeros(3, 32), torch.zeros(3, dtype=torch.long), SIN, 2, 6,
         r"cos \[10, 4\] and sin \[10, 4\] must both be \[positions, at most 3\]"),
        (torch.zeros(3, 32), torch.zeros(3, dtype=torch.long), torch.zeros(9, 4), 2, 8,
         r"cos \[10, 4\] and sin \[9, 4\] must both be \[positions, at most 4\]"),
        (torch.zeros(32), torch.zeros(1, dtype=torch.long), SIN, 2, 8,
         r"qkv \[32\] of strides \[1\] must be a \(tokens, width\) matrix"),
        (torch.zeros(3, 32), torch.zeros(3, dtype=torch.int32), SIN, 2, 8,
         "positions must be Long, not Int"),
    ],
    ids=["positions", "heads", "odd-head-dim", "tables", "sin", "1d", "int32"],
)  # fmt: skip
def test_rotary_refuses(qkv, positions, sin, heads, head_dim, message):
    with pytest.raises(RuntimeError, match="rotary: " + message):
        ops.rotary(qkv, positions, COS, sin, heads, head_dim)


ACT_AND_MUL = ["silu_and_mul", "gelu_tanh_and_mul"]


@pytest.mark.parametrize("op", ACT_AND_MUL)
@pytest.mark.parametrize("rows,features", [(0, 80), (4, 0), (0, 0)])
def test_act_and_mul_of_nothing_is_empty(rows, features, op):
    x = torch.randn(rows, 2 * features)
    out = getattr(layer_ops, op)(x)
    assert out.shape == (rows, features)
    assert torch.equal(out, getattr(layer_ops, f"{op}_torch")(x))


@pytest.mark.parametrize(
    "out,x,message",
    [
        (torch.empty(4, 80), torch.randn(3, 160), r"x \[3, 160\] must be \[4, 160\]"),
        (torch.empty(4, 80), torch.randn(4, 170), r"x \[4, 170\] must be \[4, 160\]"),
        (torch.empty(()), torch.randn(2), r"out must have at least 1 dim, not \[\]"),
        (torch.empty(4, 80).double(), torch.randn(4, 160), "out must be Float, not Double"),
    ],
    ids=["rows", "width", "scalar", "dtype"],
)
@pytest.mark.parametrize("op", ACT_AND_MUL)
def test_act_and_mul_refuses(out, x, message, op):
    with pytest.raises(RuntimeError, match=f"{op}: " + message):
        getattr(ops, op)(out, x)


# paged_attention


def attend(q, k_cache, v_cache, meta, kv=None, out=None, num_rows=None):
    """The kernel on a step, as the whole-layer op calls it when `kv` (k, v) is given."""
    out = q.new_empty(q.shape) if out is None else out
    k, v = kv if kv is not None else (None, None)
    ops.paged_attention(
        out, q, k_cache, v_cache, k, v, None if kv is None else meta.slot_mapping,
        meta.block_tables, meta.seq_lens, meta.query_start_loc,
        meta.num_rows if num_rows is None else num_rows, 0.3,
    )  # fmt: skip
    return out


@pytest.mark.parametrize("with_kv", [False, True])
def test_attention_of_a_step_without_tokens_is_empty(with_kv):
    (q, k, v, k_cache, v_cache, meta), _ = build([(5, 5)], 4, 4, 2, 8, seed=0)
    none = torch.zeros(0, dtype=torch.long)
    meta = replace(
        meta,
        slot_mapping=none,
        block_tables=torch.zeros(0, 2, dtype=torch.long),
        seq_lens=none,
        query_start_loc=torch.zeros(1, dtype=torch.long),
        num_decodes=0,
        seq_lens_cpu=[],
        query_lens_cpu=[],
    )
    before = k_cache.clone(), v_cache.clone()
    out = attend(q[:0], k_cache, v_cache, meta, kv=(k[:0], v[:0]) if with_kv else None)
    assert out.shape == (0, 4, 8)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


def test_attention_rows_of_block_sizes_off_the_kernels_tile():
    """Block size 3, lengths off both it and the kernel's 32-key tile, head dim 6."""
    args, _ = build([(35, 1), (7, 7), (67, 33)], 3, 4, 2, 6, seed=4)
    torch.testing.assert_close(
        attend(*args[:1], *args[3:]),
        REFERENCE.attend(*args, scale=0.3),
        rtol=1e-5,
        atol=1e-5,
    )


def corrupt(what: str):
    """A step whose one part `what` is wrong, and the message that must name it."""
    (q, k, v, k_cache, v_cache, meta), _ = build([(5, 1), (9, 4)], 4, 4, 2, 8, seed=1)
    kv, out, rows = None, None, None
    if what == "block-size-0":
        k_cache = v_cache = torch.zeros(6, 0, 2, 8)
        message = r"k_cache \[6, 0, 2, 8\] must be \(blocks, block_size >= 1, kv_heads >= 1"
    elif what == "kv-heads-0":
        k_cache = v_cache = torch.zeros(6, 4, 0, 8)
        message = r"k_cache \[6, 4, 0, 8\] must be \(blocks, block_size >= 1, kv_heads >= 1"
    elif what == "heads-off-groups":
        k_cache = v_cache = torch.zeros(6, 4, 3, 8)
        message = "q's 4 heads must be a positive multiple of the caches' 3 KV heads"
    elif what == "head-dim":
        q = torch.zeros(5, 4, 16)
        message = r"k_cache \[\d+, 4, 2, 8\] must be .*q's head_dim 16"
    elif what == "v-cache":
        v_cache = v_cache[:-1].contiguous()
        message = r"v_cache \[\d+, 4, 2, 8\] must be k_cache's"
    elif what == "out":
        out = torch.empty(4, 4, 8)
        message = r"out \[4, 4, 8\] must be q's \[5, 4, 8\]"
    elif what == "num-rows":
        rows = 3
        message = r"block_tables \[2, \d+\] must be \[num_rows 3, blocks\]"
    elif what == "seq-lens":
        meta.seq_lens = meta.seq_lens[:1]
        message = r"seq_lens \[1\] must be \[num_rows 2\]"
    elif what == "starts":
        meta.query_start_loc = torch.tensor([0, 1, 4])
        message = "query_start_loc must run from 0 to q's 5 tokens, not from 0 to 4"
    elif what == "short-context":
        meta.seq_lens = torch.tensor([5, 3])
        message = "row 1 has 4 new tokens and seq_lens 3; its context must hold its new tokens"
    elif what == "long-context":
        meta.seq_lens = torch.tensor([5, 4 * meta.block_tables.shape[1] + 1])
        message = r"row 1's \d+ tokens need \d+ blocks of 4, block_tables has \d+"
    elif what == "table-entry":
        meta.block_tables[1, 2] = len(k_cache)
        message = rf"block_tables\[1\]\[2\] = {len(k_cache)} outside the caches' {len(k_cache)}"
    elif what == "tables-int32":
        meta.block_tables = meta.block_tables.int()
        message = "block_tables must be Long, not Int"
    elif what == "fp16":
        q, k_cache, v_cache = q.half(), k_cache.half(), v_cache.half()
        message = "q must be float32 or bfloat16, not Half"
    elif what == "cache-dtype":
        v_cache = v_cache.bfloat16()
        message = "v_cache must be Float, not BFloat16"
    elif what == "k-tokens":
        kv = k[:4], v[:4]
        message = r"k \[4, 2, 8\] and v \[4, 2, 8\] must be \[5, 2, 8\]"
    elif what == "slot-mapping":
        kv = k, v
        meta.slot_mapping = meta.slot_mapping[:3]
        message = r"slot_mapping \[3\] must be \[5\], one slot per token"
    return (q, k_cache, v_cache, meta, kv, out, rows), message


@pytest.mark.parametrize(
    "what",
    [
        "block-size-0", "kv-heads-0", "heads-off-groups", "head-dim", "v-cache", "out",
        "num-rows", "seq-lens", "starts", "short-context", "long-context", "table-entry",
        "tables-int32", "fp16", "cache-dtype", "k-tokens", "slot-mapping",
    ],
)  # fmt: skip
def test_attention_refuses(what):
    args, message = corrupt(what)
    with pytest.raises(RuntimeError, match="paged_attention: " + message):
        attend(*args)


# decoder_attention, decoder_mlp: a layer's halves


def layer_args(model, tokens: int) -> tuple[dict, dict]:
    """decoder_attention's and decoder_mlp's arguments for a step of `tokens` new tokens of one
    row, all in the caches' block 0 onwards."""
    layer, c = model.model.layers[0], model.config
    # The Llama layer's arguments; Gemma's after them keep their defaults.
    weights, bias, q_norm, k_norm, heads, kv_heads, eps, scale, window = layer.attention_args[:9]
    mlp_weights, inter, _ = layer.mlp_args[:3]
    blocks = max(1, -(-tokens // BLOCK))
    rows = 1 if tokens else 0
    gen = torch.Generator().manual_seed(tokens)
    cache = (blocks + 1, BLOCK, kv_heads, c.head_dim)
    residual = torch.randn(tokens, c.hidden_size, generator=gen).to(model.dtype)
    attention = dict(
        hidden=torch.randn(tokens, c.hidden_size, generator=gen).to(model.dtype),
        residual=residual,
        positions=torch.arange(tokens),
        cos=model.rope.cos,
        sin=model.rope.sin,
        k_cache=torch.randn(cache, generator=gen).to(model.dtype),
        v_cache=torch.randn(cache, generator=gen).to(model.dtype),
        slot_mapping=torch.arange(tokens),
        block_tables=torch.arange(blocks).repeat(rows, 1),
        seq_lens=torch.tensor([tokens] * rows, dtype=torch.long),
        query_start_loc=torch.tensor([0, tokens][: rows + 1]),
        num_rows=rows,
        weights=weights,
        qkv_bias=bias,
        q_norm=q_norm,
        k_norm=k_norm,
        heads=heads,
        kv_heads=kv_heads,
        eps=eps,
        scale=scale,
        window=window,
    )
    o = torch.randn(tokens, c.hidden_size, generator=gen).to(model.dtype)
    mlp = dict(o=o, residual=residual, weights=mlp_weights, intermediate=inter, eps=eps)
    return attention, mlp


@pytest.fixture(scope="module", params=["none", "int4"])
def model(request):
    return _model("llama", request.param, torch.float32)


def test_a_layer_over_no_tokens_changes_nothing(model):
    attention, mlp = layer_args(model, 0)
    before = {k: attention[k].clone() for k in ("residual", "k_cache", "v_cache")}
    assert ops.decoder_attention(**attention).shape == (0, model.config.hidden_size)
    assert ops.decoder_mlp(**mlp).shape == (0, model.config.hidden_size)
    for name, tensor in before.items():
        assert torch.equal(attention[name], tensor), name


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(heads=0), "decoder_attention: heads 0 and kv_heads 2 must be >= 1"),
        (dict(k_cache=torch.zeros(3, 4, 2)), r"decoder_attention: k_cache \[3, 4, 2\] must be"),
        (dict(residual=torch.zeros(5, 64).T), r"decoder_attention: residual \[64, 5\] must be"),
        (
            dict(hidden=torch.zeros(4, 64)),
            r"decoder_attention: hidden \[4, 64\] must be residual's",
        ),
        (dict(positions=torch.arange(4)), r"rotary: positions \[4\] must be \[5\]"),
        (dict(qkv_bias=torch.zeros(7)), r"linear: bias \[7\] must be \[128\], one per output"),
        (dict(hidden_norm=torch.ones(7)), r"rms_norm: weight \[7\] must be \[64\]"),
        (dict(softcap=0.0), "paged_attention: softcap 0 must be > 0"),
    ],
    ids=["heads", "cache", "residual", "hidden", "positions", "bias", "hidden_norm", "softcap"],
)
def test_attention_half_refuses(model, change, message):
    attention, _ = layer_args(model, 5)
    with pytest.raises(RuntimeError, match=message):
        ops.decoder_attention(**attention | change)


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(intermediate=0), "decoder_mlp: intermediate 0 must be >= 1"),
        (dict(intermediate=96), "(linear: dense weight|quant_linear: packed weights)"),
        (dict(residual=torch.zeros(5, 64).T), r"decoder_mlp: residual \[64, 5\] must be"),
        (dict(o=torch.zeros(4, 64)), r"decoder_mlp: o \[4, 64\] must be residual's \[5, 64\]"),
        (dict(o_norm=torch.ones(7)), r"rms_norm: weight \[7\] must be \[64\]"),
        (dict(activation="relu"), "decoder_mlp: activation 'relu' must be 'silu' or 'gelu_tanh'"),
    ],
    ids=["zero", "intermediate", "residual", "o", "o_norm", "activation"],
)
def test_mlp_half_refuses(model, change, message):
    _, mlp = layer_args(model, 5)
    with pytest.raises(RuntimeError, match=message):
        ops.decoder_mlp(**mlp | change)
