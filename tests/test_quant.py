"""Quantized linear layers (model/quant.py, quant_linear.cpp) against dequantize-then-matmul,
and GGUF's stored groups (loaders/gguf.py) against the gguf library's own dequantization."""

import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from torch import nn

from tinyllm.loaders.gguf_blocks import stored_groups
from tinyllm.model import cpu_library, precision
from tinyllm.model.config import ModelConfig
from tinyllm.model.llama import Transformer
from tinyllm.model.precision import resolve_dtype, resolve_quantization
from tinyllm.model.quant import (
    GroupQuantized,
    QuantEmbedding,
    QuantLinear,
    int4_groups,
    int8_groups,
    pack,
    quantize_linears,
    unpack,
)

Q = gguf.GGMLQuantizationType


def fp16(t: torch.Tensor) -> torch.Tensor:
    return t.half().float()


def random_groups(n: int, k: int, bits: int, gen: torch.Generator) -> GroupQuantized:
    """Random codes with fp16 scales and offsets, as GGUF stores them."""
    scale = fp16(torch.rand(n, k // 32, generator=gen) * 0.02 + 1e-3)
    if bits == 4:
        q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
        zero = fp16(-8 * scale + torch.randn(n, k // 32, generator=gen) * 0.01)
    else:
        q = torch.randint(1, 256, (n, k), generator=gen, dtype=torch.uint8)
        zero = -128 * scale
    return GroupQuantized(q, scale, zero, bits=bits)


def quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel sees it: per block of 32 (zero-padded), two int8 codes on grids of
    max|x| / 127 and 254 times finer."""
    k = x.shape[-1]
    g = nn.functional.pad(x.float(), (0, -k % 32)).view(len(x), -(-k // 32), 32)
    amax = g.abs().amax(-1, keepdim=True)
    scaled = g * torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    coarse = scaled.round()
    fine = ((scaled - coarse) * 254).round()
    return ((coarse + fine / 254) * (amax / 127)).flatten(1)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_gguf_groups_are_the_stored_weights(qtype):
    """The groups read from a tensor's blocks dequantize to what the gguf library reads, and
    survive the kernel's packing unchanged."""
    w = np.random.default_rng(0).standard_normal((24, 96)).astype(np.float32)
    blocks = gguf.quants.quantize(w, qtype)
    groups = stored_groups(blocks, qtype, w.shape)
    assert groups.bits == (8 if qtype == Q.Q8_0 else 4)
    expected = torch.from_numpy(gguf.quants.dequantize(blocks, qtype).astype(np.float32))
    torch.testing.assert_close(groups.dequantize(), expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(unpack(pack(groups), groups.bits)[:24], expected, rtol=0, atol=0)


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_round_trips_and_pads_rows_to_tiles(bits):
    g = random_groups(40, 96, bits, torch.Generator().manual_seed(bits))
    packed = pack(g)
    assert packed.shape == (3, 3, 16 * 32 * bits // 8 + 64)  # 40 rows in 3 tiles of 16
    dense = unpack(packed, bits)
    assert torch.equal(dense[:40], g.dequantize())
    assert not dense[40:].any()


def reference_pack(w: GroupQuantized) -> torch.Tensor:
    """pack as first written (permute, combine nibbles, concatenate): the byte layout the
    in-place pack must keep."""
    u = w.q.to(torch.uint8)
    pad = -len(u) % 16
    u, d, m = (nn.functional.pad(t, (0, 0, 0, pad)) for t in (u, w.scale, w.zero))
    tiles, blocks = len(u) // 16, d.shape[1]
    if w.bits == 4:
        c = u.view(tiles, 16, blocks, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)
        codes = (c[..., 0] | c[..., 1] << 4).reshape(tiles, blocks, -1)
    else:
        codes = u.view(tiles, 16, blocks, 8, 4).permute(0, 2, 3, 1, 4).reshape(tiles, blocks, -1)
    d, m = (t.view(tiles, 16, blocks).transpose(1, 2).half() for t in (d, m))
    scales = torch.cat([d, m], dim=-1).contiguous().view(torch.uint8)
    return torch.cat([codes, scales], dim=-1).contiguous()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape", [(64, 256), (40, 96), (16, 32), (1, 64)])
def test_pack_bytes_are_the_reference_layout(bits, shape):
    """Every byte of pack's output, padding included, is what the reference layout gives, for
    random codes and for scales that fp16 must round (as int4_groups' unrounded ones)."""
    gen = torch.Generator().manual_seed(sum(shape) + bits)
    g = random_groups(*shape, bits, gen)
    g.scale = g.scale * (1 + torch.rand(g.scale.shape, generator=gen) * 1e-3)
    assert torch.equal(pack(g), reference_pack(g))


SHAPES = [(96, 128), (40, 70), (33, 32)]  # K = 70: a partial last block; N = 33, 40: tiles


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 3, 7, 64])
@pytest.mark.parametrize("shape", SHAPES)
def test_quant_linear_is_dequantize_then_matmul(bits, rows, shape):
    """Every row count (the kernel runs rows in fours, then the rest) and ragged shapes, with
    a bias: the kernel's sums equal the float64 product of the same numbers (up to a fine
    code that rounds the other way: 1e-4 here, where a coarse one would be 254 times that)."""
    n, k = shape
    gen = torch.Generator().manual_seed(rows * n + bits)
    w = torch.randn(n, k, generator=gen)
    groups = (int4_groups if bits == 4 else int8_groups)(w)
    bias = torch.randn(n, generator=gen)
    layer = QuantLinear(groups, bias, torch.float32, in_features=k)
    x = torch.randn(rows, k, generator=gen)
    dense = groups.dequantize().double()  # K zero-padded to whole groups, as the activations
    expected = quantized_activations(x).double() @ dense.T + bias
    torch.testing.assert_close(layer(x).double(), expected, rtol=1e-4, atol=1e-3)
    # Against the unrounded activations: their rounding costs about 15 bits.
    exact = x.double() @ groups.dequantize()[:, :k].double().T + bias
    assert (layer(x) - exact).abs().max() < 1e-4 * exact.abs().max()


def assert_rows_alone_match_batched() -> None:
    """Each row's outputs have the same bits alone as among many: prompts run in slices of rows
    and spans of blocks (K = 4160: 130 blocks, past one span and not a multiple of it; 150
    rows, past one slice), decode rows in groups of 4, and neither may change a row's sums."""
    from tinyllm.model.quant import int4_groups, int8_groups, pack

    gen = torch.Generator().manual_seed(4)
    for bits, quantize in ((4, int4_groups), (8, int8_groups)):
        g = quantize(torch.randn(40, 4160, generator=gen) * 0.02)
        packed = pack(g)
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(150, 4160, generator=gen).to(dtype)
            y = torch.ops.tinyllm.quant_linear(x, packed, 40, bits)
            for part in (slice(0, 1), slice(61, 62), slice(149, 150), slice(3, 6), slice(9, 140)):
                alone = torch.ops.tinyllm.quant_linear(x[part].contiguous(), packed, 40, bits)
                assert torch.equal(alone, y[part]), (bits, dtype, part)


def test_a_rows_outputs_do_not_depend_on_the_rows_beside_it():
    assert cpu_library.library_error() is None  # loads the library
    assert_rows_alone_match_batched()


def test_quant_linear_takes_bf16_activations():
    gen = torch.Generator().manual_seed(1)
    groups = random_groups(64, 256, 4, gen)
    x = torch.randn(5, 256, generator=gen).bfloat16()
    y = QuantLinear(groups, None, torch.bfloat16, in_features=256)(x)
    assert y.dtype == torch.bfloat16
    expected = quantized_activations(x).double() @ groups.dequantize().double().T
    # The same sums, rounded once to bf16 (8 bits of mantissa).
    torch.testing.assert_close(y.double(), expected, rtol=4e-3, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7])  # the vector path, and AMX tiles where the CPU has them
def test_a_nan_activation_makes_its_rows_outputs_nan(dtype, rows):
    """As a float matrix product: a NaN is no number to quantize, and a code made of one gave
    plausible outputs. The other rows stay as they were."""
    gen = torch.Generator().manual_seed(2)
    layer = QuantLinear(random_groups(48, 96, 4, gen), None, dtype, in_features=96)
    x = torch.randn(rows, 96, generator=gen).to(dtype)
    clean = layer(x)
    x[0, 40] = float("nan")
    y = layer(x)
    assert y[0].isnan().all()
    assert torch.equal(y[1:], clean[1:])


def test_quant_linear_rejects_weights_of_another_shape():
    layer = QuantLinear(random_groups(32, 64, 4, torch.Generator()), None, torch.float32, 64)
    with pytest.raises(RuntimeError, match="do not fit 32 outputs of 96 inputs at 4 bits"):
        layer(torch.randn(2, 96))


def test_int4_groups_keep_weights_already_on_a_4bit_grid():
    """Min-max quantization recovers a Q4_1-style weight whose groups span their whole grid."""
    w = random_groups(8, 64, 4, torch.Generator().manual_seed(2))
    w.q[:, ::32], w.q[:, 1::32] = 0, 15  # every group reaches both ends of its grid
    again = int4_groups(w.dequantize())
    torch.testing.assert_close(again.dequantize(), w.dequantize(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("quantize", [int4_groups, int8_groups])
def test_groups_error_is_about_half_a_step(quantize):
    """Within half a step of the fp16 grid, plus the fp16 rounding of the group's scale."""
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(3))
    g = quantize(w)
    assert g.scale.equal(fp16(g.scale)) and g.zero.equal(fp16(g.zero))  # what pack stores
    step = g.scale.repeat_interleave(32, dim=1)
    assert ((g.dequantize() - w).abs() <= step * 0.51 + 1e-6).all()


def test_quantize_linears_rewrites_every_linear_and_ties_the_embedding():
    torch.manual_seed(6)
    config = ModelConfig("llama", 64, 64, 96, 1, 2, 1, 32, 48, tie_word_embeddings=True)
    dense = Transformer(config)
    dense.load_weights(dict(dense.state_dict()))
    state = dict(dense.state_dict())
    with torch.device("meta"):
        model = Transformer(config)
    rest = quantize_linears(model, state, "int4", torch.float32)
    assert state.keys() == rest.keys()  # consumed: the linears' weights freed as they are packed
    model.load_weights(rest)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    attn, head = model.model.layers[0].self_attn, model.lm_head
    assert isinstance(attn.qkv_proj, QuantLinear) and attn.qkv_proj.bits == 4
    assert isinstance(head, QuantLinear) and head.bits == 8
    assert isinstance(model.model.embed_tokens, QuantEmbedding)
    ids = torch.tensor([[3, 9, 1], [63, 16, 15]])  # rows of different tiles
    emb = model.model.embed_tokens(ids)
    assert emb.shape == (2, 3, 64)
    torch.testing.assert_close(emb, unpack(head.packed, 8)[ids])
    step = dense.model.embed_tokens.weight.abs().max() / 127
    assert (emb - dense.model.embed_tokens(ids)).abs().max() <= step / 2 * 1.01


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


def test_resolve_quantization_without_the_kernels(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(precision, "library_error", lambda: "no C++ compiler")
    assert resolve_quantization("auto", {4}, cpu) == (
        "none",
        "tinyllm's CPU kernels did not build: no C++ compiler",
    )
    with pytest.raises(ValueError, match="did not build \\(no C\\+\\+ compiler\\)"):
        resolve_quantization("int4", {4}, cpu)


def test_resolve_dtype(monkeypatch):
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", torch.device("cuda"))[0] == torch.bfloat16
    assert resolve_dtype("float32", cpu) == (torch.float32, "as asked")
    assert resolve_dtype(torch.bfloat16, cpu) == (torch.bfloat16, "as asked")
    monkeypatch.setattr(precision, "amx", lambda: False)
    assert resolve_dtype("auto", cpu)[0] == torch.float32
    monkeypatch.setattr(precision, "amx", lambda: True)
    assert resolve_dtype("auto", cpu)[0] == torch.bfloat16
    with pytest.raises(ValueError, match="choose one of float32, bfloat16, float16 or 'auto'"):
        resolve_dtype("fp8", cpu)


# The kernel built as a library of its own at a level, in a fresh process (its op's name is the
# main library's), then a check run on it.
AT_LEVEL = """
import sys, torch
from torch.utils.cpp_extension import load
from tinyllm.model.cpu_library import HERE, build_flags

level = sys.argv[1]
load(name=f"tinyllm_quant_{level}", sources=[str(HERE / "quant_linear.cpp")],
     extra_cflags=build_flags(level), extra_ldflags=["-fopenmp"], is_python_module=False)
"""
OTHER_LEVEL = """
from tinyllm.model.quant import int4_groups, int8_groups, pack
from tests.test_quant import assert_rows_alone_match_batched, quantized_activations

gen = torch.Generator().manual_seed(0)
for bits, quantize in ((4, int4_groups), (8, int8_groups)):
    for rows in (1, 6):
        g = quantize(torch.randn(40, 70, generator=gen))
        x = torch.randn(rows, 70, generator=gen)
        y = torch.ops.tinyllm.quant_linear(x, pack(g), 40, bits)
        expected = quantized_activations(x).double() @ g.dequantize().double().T
        torch.testing.assert_close(y.double(), expected, rtol=1e-4, atol=1e-3)
assert_rows_alone_match_batched()
print("ok")
"""


def run_at_level(level: str, check: str) -> None:
    """Run `check` (Python that prints "ok") on the kernel built for `level`, where this
    machine can run that level and the library in use is not already built for it."""
    if cpu_library.level() == level:
        pytest.skip(f"the library in use is built for {level}: every other test runs it")
    if level == "avx2" and torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("this CPU has no AVX2")
    root = Path(__file__).parents[1]
    done = subprocess.run(
        [sys.executable, "-c", AT_LEVEL + check, level], cwd=root, capture_output=True, text=True
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("level", ["avx512vnni", "avx2", "generic"])
def test_other_instruction_set_levels_compute_the_same(level):
    """The AVX512-VNNI path (on an AMX machine, whose own build runs it only below 5 rows), the
    AVX2 one (u8 x s8 pairs in int16, 8-bit codes by their sign) and the portable one, which
    this machine's own build does not run, on a machine that can run them."""
    if level == "avx512vnni" and not torch.cpu.get_capabilities().get("avx512_vnni"):
        pytest.skip("this CPU has no AVX512-VNNI")
    run_at_level(level, OTHER_LEVEL)


def outputs_at_row_counts() -> list[torch.Tensor]:
    """quant_linear's outputs at every row count from 1 to 17 (groups of 8 rows; a last group of
    1-4 rows on the VNNI path, of 5-7 on tiles of their own), at one of a prefill's sizes, in
    fp32 and bf16, for 4- and 8-bit weights whose K is not a multiple of 32."""
    from tinyllm.model.quant import int4_groups, int8_groups, pack

    gen = torch.Generator().manual_seed(3)
    outputs = []
    for bits, quantize in ((4, int4_groups), (8, int8_groups)):
        g = quantize(torch.randn(72, 150, generator=gen))
        for rows in (*range(1, 18), 61):
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(rows, 150, generator=gen).to(dtype)
                outputs.append(torch.ops.tinyllm.quant_linear(x, pack(g), 72, bits))
    return outputs


VNNI_OUTPUTS = """
from tests.test_quant import outputs_at_row_counts

torch.save(outputs_at_row_counts(), sys.argv[2])
print("ok")
"""


@pytest.mark.slow
def test_amx_tiles_give_the_vnni_paths_bits(tmp_path):
    """On a CPU with AMX, 5 rows and more run as tile products: each output must have the bits
    the VNNI path gives it (the AVX512-VNNI build, in a fresh process), at every row count, so
    that a row's tokens never depend on what shares its batch."""
    if cpu_library.level() != "avx512amx":
        pytest.skip("the library in use is not built for AMX")
    assert cpu_library.library_error() is None
    path = tmp_path / "vnni.pt"
    done = subprocess.run(
        [sys.executable, "-c", AT_LEVEL + VNNI_OUTPUTS, "avx512vnni", str(path)],
        cwd=Path(__file__).parents[1],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
    for ours, vnni in zip(outputs_at_row_counts(), torch.load(path), strict=True):
        assert torch.equal(ours, vnni)


def test_a_level_can_be_forced_but_not_misnamed(monkeypatch):
    monkeypatch.setenv("TINYLLM_CPU_LEVEL", "generic")
    assert cpu_library.level() == "generic"
    monkeypatch.setenv("TINYLLM_CPU_LEVEL", "avx9")
    with pytest.raises(ValueError, match="TINYLLM_CPU_LEVEL='avx9': choose one of avx512amx"):
        cpu_library.level()


AVX2_ONLY = dict.fromkeys(cpu_library.NEEDS["avx2"], True)
AVX512_VNNI = dict.fromkeys(cpu_library.NEEDS["avx512vnni"], True)  # no AVX-VNNI (Cascade Lake)


@pytest.mark.parametrize(
    "capability,flags,forced,expected,missing",
    [
        ("AVX2", AVX2_ONLY, "avx512vnni", "avx2", "avx512_f, avx512_bw"),
        ("AVX512", AVX512_VNNI, "avx512amx", "avx512vnni", "amx_tile, amx_int8"),
        ("AVX2", AVX2_ONLY, "avx2vnni", "avx2", "avx_vnni"),
        ("AVX512", AVX512_VNNI, "avx2vnni", "avx512vnni", "avx_vnni"),
        ("DEFAULT", {}, "avx2", "generic", "avx, avx2"),
        ("AVX512", AVX512_VNNI, "avx2", "avx2", None),
        ("AVX2", AVX2_ONLY, "generic", "generic", None),
    ],
)
def test_a_forced_level_this_cpu_cannot_run_falls_back_to_its_own(
    monkeypatch, caplog, capability, flags, forced, expected, missing
):
    """A build for extensions the CPU lacks would die of SIGILL at its first kernel, without a
    message; a lower level is honoured."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: flags)
    monkeypatch.setenv("TINYLLM_CPU_LEVEL", forced)
    with caplog.at_level("WARNING", logger="tinyllm"):
        assert cpu_library.level() == expected
    if missing is None:
        assert caplog.text == ""
    else:
        assert f"TINYLLM_CPU_LEVEL={forced} needs {missing}" in caplog.text
        assert f"which this CPU lacks: using this CPU's level, {expected}" in caplog.text


def test_this_cpus_own_level_is_never_refused(monkeypatch, caplog):
    """What the detection picks, every extension its build needs is in torch's flags: a
    misspelt flag in NEEDS would refuse it."""
    monkeypatch.delenv("TINYLLM_CPU_LEVEL", raising=False)
    own = cpu_library.level()
    monkeypatch.setenv("TINYLLM_CPU_LEVEL", own)
    with caplog.at_level("WARNING", logger="tinyllm"):
        assert cpu_library.level() == own
    assert caplog.text == ""


def test_4bit_groups_widen_to_8_bits_up_to_the_fp16_offset():
    g = random_groups(32, 64, 4, torch.Generator().manual_seed(7))
    wide = g.widened()
    assert wide.bits == 8 and int(wide.q.min()) >= 1
    packed = unpack(pack(wide), 8)
    # Only m - d is rounded to fp16: half an fp16 step of it.
    bound = (g.zero - g.scale).abs().repeat_interleave(32, dim=1) * 2**-11
    assert ((packed - g.dequantize()).abs() <= bound + 1e-9).all()


def test_8bit_codes_of_zero_are_refused():
    g = random_groups(16, 32, 8, torch.Generator().manual_seed(8))
    g.q[3, 5] = 0
    with pytest.raises(ValueError, match="8-bit codes must be in 1..255"):
        pack(g)
