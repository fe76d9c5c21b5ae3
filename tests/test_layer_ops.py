"""The C++ layer ops (model/layer_ops.cpp) against their torch versions, and the rotary
embedding against transformers' own."""

import re
from pathlib import Path

import pytest
import torch

# Phi-3's: Llama's rotation, over each head's first dims where the tables are narrower.
from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

from tinyllm.model import cpu_library, layer_ops
from tinyllm.model.cpu_library import library_error

pytestmark = pytest.mark.skipif(
    library_error() is not None, reason=f"CPU library did not build: {library_error()}"
)
DTYPES = [torch.float32, torch.bfloat16]


def tol(dtype):
    # bf16 results may differ by a rounding step where the ops round in another order.
    return dict(rtol=0, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 37])
def test_rms_norm(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 96, generator=gen) * 3).to(dtype)
    w = torch.randn(96, generator=gen).to(dtype)
    assert layer_ops.native(x)
    torch.testing.assert_close(
        layer_ops.rms_norm(x, w, 1e-5), layer_ops.rms_norm_torch(x, w, 1e-5), **tol(dtype)
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_adds_the_residual_in_place(dtype):
    gen = torch.Generator().manual_seed(1)
    x, res = (torch.randn(5, 64, generator=gen).to(dtype) for _ in range(2))
    w = torch.randn(64, generator=gen).to(dtype)
    expected_out, expected_sum = layer_ops.rms_norm_torch(x, w, 1e-6, res.clone())
    out, new_res = layer_ops.rms_norm(x, w, 1e-6, res)
    assert new_res.data_ptr() == res.data_ptr()
    torch.testing.assert_close(new_res, expected_sum, rtol=0, atol=0)
    torch.testing.assert_close(out, expected_out, **tol(dtype))


@pytest.mark.parametrize("rotated", [64, 48], ids=["whole-head", "partial"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_matches_transformers(dtype, rotated):
    """q and k heads rotated in place inside a fused qkv row, v untouched, as transformers'
    apply_rotary_pos_emb rotates separate q and k; with partial rotary (Phi-4-mini), only each
    head's first `rotated` dims."""
    gen = torch.Generator().manual_seed(2)
    n, hq, hkv, d = 7, 4, 2, 64
    inv = 1.0 / (10000 ** (torch.arange(0, rotated, 2).double() / rotated))
    freqs = torch.outer(torch.arange(100).double(), inv)
    cos, sin = freqs.cos().float(), freqs.sin().float()
    positions = torch.randint(0, 100, (n,), generator=gen)
    qkv = torch.randn(n, (hq + 2 * hkv) * d, generator=gen).to(dtype)
    before = qkv.clone()
    layer_ops.rotary(qkv, positions, cos, sin, hq + hkv, d)
    q, k = before[:, : hq * d].view(n, hq, d), before[:, hq * d : (hq + hkv) * d].view(n, hkv, d)
    emb = torch.cat([freqs, freqs], dim=-1)[positions]
    # transformers' layout: (batch, heads, tokens, head_dim), cos and sin (batch, tokens, dim).
    hf_q, hf_k = apply_rotary_pos_emb(
        *(t.float().transpose(0, 1)[None] for t in (q, k)), emb.cos()[None], emb.sin()[None]
    )
    for ours, theirs in ((qkv[:, : hq * d], hf_q), (qkv[:, hq * d : (hq + hkv) * d], hf_k)):
        theirs = theirs[0].transpose(0, 1).reshape(n, -1).to(dtype)
        torch.testing.assert_close(ours, theirs, **tol(dtype))
    assert torch.equal(qkv[:, (hq + hkv) * d :], before[:, (hq + hkv) * d :])
    torch_version = before.clone()
    layer_ops.rotary_torch(torch_version, positions, cos, sin, hq + hkv, d)
    torch.testing.assert_close(qkv, torch_version, **tol(dtype))


def test_rotary_refuses_a_position_outside_the_table():
    cos = sin = torch.zeros(10, 4)
    with pytest.raises(RuntimeError, match="position 10 outside the table's 10"):
        layer_ops.rotary(torch.zeros(1, 16), torch.tensor([10]), cos, sin, 2, 8)


@pytest.mark.parametrize("op", ["silu_and_mul", "gelu_tanh_and_mul"])  # SwiGLU's, Gemma's GeGLU's
@pytest.mark.parametrize("dtype", DTYPES)
def test_act_and_mul(dtype, op):
    x = (torch.randn(9, 2 * 80, generator=torch.Generator().manual_seed(3)) * 4).to(dtype)
    out = getattr(layer_ops, op)(x)
    assert out.shape == (9, 80)
    torch.testing.assert_close(out, getattr(layer_ops, f"{op}_torch")(x), **tol(dtype))


@pytest.fixture
def builds(monkeypatch, tmp_path):
    """An install without libraries (its folder empty), whose builds `fail` names the levels of
    (the compiler's output as the error) and whose loads are only recorded: the levels built,
    then the libraries loaded."""
    built, loaded, fail = [], [], {}

    def build(names, directory):
        errors = {name: fail[name] for name in names if name in fail}
        for name in set(names) - set(errors):
            built.append(name)
            (directory / cpu_library.library_file(name)).touch()
        return errors

    monkeypatch.setattr(cpu_library, "KERNELS", tmp_path)
    monkeypatch.setattr(cpu_library, "_build_directory", lambda: tmp_path)
    monkeypatch.setattr(cpu_library, "build", build)
    monkeypatch.setattr(torch.ops, "load_library", lambda path: loaded.append(Path(path).name))
    return built, loaded, fail


def test_a_compiler_without_amx_flags_still_builds_the_vnni_kernels(builds, monkeypatch, caplog):
    """GCC before 11 rejects -mamx-tile: an AMX machine with such a compiler keeps the kernels,
    built one level down, and says why."""
    built, loaded, fail = builds
    fail["avx512amx"] = "c++ ... -mamx-tile\nc++: error: unrecognized command-line option"
    monkeypatch.setattr(cpu_library, "level", lambda: "avx512amx")
    with caplog.at_level("WARNING", logger="tinyllm"):
        cpu_library._load()
    assert built == ["avx512vnni"]
    assert loaded == [cpu_library.library_file("avx512vnni")]
    assert "did not build for avx512amx (c++: error: unrecognized command-line option)" in (
        caplog.text
    )


def test_a_failed_build_below_amx_is_not_retried(builds, monkeypatch):
    built, loaded, fail = builds
    fail["avx512vnni"] = "c++: error: something else"
    monkeypatch.setattr(cpu_library, "level", lambda: "avx512vnni")
    with pytest.raises(RuntimeError, match="something else"):
        cpu_library._load()
    assert built == loaded == []


def test_a_first_build_says_so_before_it_starts_and_when_done(builds, caplog):
    """Building takes 15 s to minutes, once per install that lacks the library: a user sees why
    start-up paused, and for how long."""
    built, loaded, _ = builds
    with caplog.at_level("WARNING", logger="tinyllm"):
        cpu_library._load()
    start, done = caplog.messages
    files = len(cpu_library.SOURCES)
    assert start.startswith(f"compiling tinyllm's CPU kernels ({files} C++ files, for ")
    assert "once: 15 s, a few minutes on a busy machine" in start
    level = cpu_library.level()
    assert re.fullmatch(rf"tinyllm's CPU kernels \({level}\) compiled in \d+\.\d s", done)
    caplog.clear()
    with caplog.at_level("WARNING", logger="tinyllm"):
        cpu_library._load()
    assert caplog.text == ""
    assert built == [level] and loaded == [cpu_library.library_file(level)] * 2
