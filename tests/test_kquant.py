"""GGUF's quantized block types (loaders/gguf_blocks.py) against the gguf package's own
`dequantize`, the oracle: blocks in each type's byte layout (tests/gguf_encoders.py), packed
for the kernel and multiplied by it; the encoders' K-quant quantizers against it; a tiny Llama
file of K-quant tensors against transformers on the same file; and files tinyllm cannot run,
refused in one line."""

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from tests.gguf_encoders import quantize, random_blocks
from tests.model_runs import load, prompt_logits
from tests.test_gguf_loader import HEADS, hf_weights, write_gguf
from tests.test_quant import quantized_activations, run_at_level
from tinyllm.entrypoints import cli
from tinyllm.loaders.gguf_blocks import GROUP_TYPES, KERNEL_BITS, groups
from tinyllm.model.config import ModelLoadError
from tinyllm.model.llama import Transformer
from tinyllm.model.quant import pack, unpack

Q = gguf.GGMLQuantizationType
TYPES = list(KERNEL_BITS)

# Packed exactly: the file's fp16 d and m are the kernel's.
EXACT = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0)


def file_weights(qtype: Q, n: int, k: int, seed: int = 0):
    """A random tensor of `qtype`: the oracle's dense weights and tinyllm's groups of it."""
    blocks = random_blocks((n, k), qtype, np.random.default_rng(seed))
    oracle = torch.from_numpy(gguf.quants.dequantize(blocks, qtype)).double()
    return oracle, groups(blocks, qtype, (n, k))


def packing_error_bound(qtype: Q, oracle: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """What packing may change in each weight: nothing (EXACT); the fp16 rounding of d and m,
    2^-11 of |d u| + |m| each, under 2^-9 of the largest |w| (random_blocks keeps |m| < |w|
    max); or, rounded again to the kernel's grid, half its `step` (the group's d)."""
    if qtype in EXACT:
        return torch.zeros_like(oracle)
    if qtype in GROUP_TYPES:
        return torch.full_like(oracle, 2**-9 * oracle.abs().max().item())
    return 0.501 * step.double().repeat_interleave(32, dim=1)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_packed_weights_are_the_files(qtype: Q):
    n, k = 40, 512  # 3 tiles of 16 rows, the last partly padding; 2 K-quant super-blocks
    oracle, g = file_weights(qtype, n, k)
    assert g.bits == KERNEL_BITS[qtype]
    packed = unpack(pack(g), g.bits)[:n].double()
    error = (packed - oracle).abs()
    assert (error <= packing_error_bound(qtype, oracle, g.scale)).all(), error.max()
    if qtype in GROUP_TYPES:  # the sub-blocks of 32 as they are: no error of a grid's size
        assert error.max() < 1e-3 * oracle.abs().max()


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_quantizers_write_blocks_the_library_decodes_to_the_weights(qtype: Q):
    """tests/gguf_encoders.py's quantizers, which benchmarks/gguf_perplexity.py writes its
    Q4_K_M file with: every weight within about one step of its sub-block's min-max grid (half
    a step rounding, plus the grid's 6- or 8-bit scale and a search that may shrink it; a
    misplaced field or nibble is many steps off), zeros exact, and the error at its bits among
    the gguf package's own types."""
    rng = np.random.default_rng(0)
    w = (0.02 * rng.standard_normal((32, 512))).astype(np.float32)
    w[rng.random(w.shape) < 0.01] *= 6  # outliers, as real weights have
    w[0] = 0
    blocks = quantize(w, qtype)
    assert blocks.shape == gguf.quants.quant_shape_to_byte_shape(w.shape, qtype)
    error = np.abs(gguf.quants.dequantize(blocks, qtype) - w)
    assert (error[0] == 0).all()
    sub = 32 if qtype == Q.Q4_K else 16
    s = w[1:].reshape(31, -1, sub)
    if qtype == Q.Q4_K:  # codes 0..15 from the sub-block's min (or 0) to its max
        step = (s.max(-1) - np.minimum(s.min(-1), 0)) / 15
    else:  # codes -32..31, the largest |w| at -32
        step = np.abs(s).max(-1) / 32
    assert (error[1:].reshape(s.shape) <= 1.25 * step[..., None]).all()
    rms = {
        t: np.sqrt(np.mean((gguf.quants.dequantize(quantize(w, t), t) - w) ** 2))
        for t in (Q.Q4_1, Q.Q5_0, Q.Q8_0)
    }
    mine = np.sqrt(np.mean(error**2))
    if qtype == Q.Q4_K:  # 4 bits, but a searched grid: under Q4_1's min-max one
        assert mine < rms[Q.Q4_1]
    else:
        assert rms[Q.Q8_0] < mine < rms[Q.Q5_0]


def check_product(qtype: Q, kernel) -> None:
    """`kernel` (torch.ops.tinyllm.quant_linear) on a `qtype` tensor: the dense product of the
    oracle's weights with the activations as the kernel rounds them, up to the kernel's own
    float sums and the packing's change to each weight (packing_error_bound)."""
    n, k = 40, 512
    oracle, g = file_weights(qtype, n, k, seed=1)
    bound = packing_error_bound(qtype, oracle, g.scale)
    gen = torch.Generator().manual_seed(2)
    for rows in (1, 6):  # the kernel runs rows in fours, then the rest
        x = torch.randn(rows, k, generator=gen)
        y = kernel(x, pack(g), n, g.bits).double()
        xq = quantized_activations(x).double()
        expected = xq @ oracle.T
        slack = 1e-4 * expected.abs().max() + xq.abs() @ bound.T
        assert ((y - expected).abs() <= slack).all(), (y - expected).abs().max()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_kernel_multiplies_the_files_weights(qtype: Q):
    from tinyllm.model.cpu_library import library_error

    assert library_error() is None
    check_product(qtype, torch.ops.tinyllm.quant_linear)


@pytest.mark.slow
@pytest.mark.parametrize("level", ["avx2", "generic"])
def test_other_instruction_set_levels_multiply_every_type(level):
    """The AVX2 path multiplies 8-bit codes by the activations' sign, which a code of 0 would
    break: the 5-bit types' shifted codes on it and on the portable path."""
    check = (
        "from tests.test_kquant import TYPES, check_product\n"
        "for qtype in TYPES:\n"
        "    check_product(qtype, torch.ops.tinyllm.quant_linear)\n"
        "print('ok')\n"
    )
    run_at_level(level, check)


# ---- a whole model file, against transformers' own GGUF loader ----

HIDDEN, FFN, HEAD_DIM = 256, 512, 64  # K-quant rows are whole super-blocks of 256
# Each layer's tensors in a different type, as llama.cpp's mixes (Q4_K_M) put them, with the
# largest difference seen from transformers' logits, over their standard deviation: packed as
# stored, only the fp16 rounding of d and m and the activations' (0.18% measured); with the
# types rounded again (Q6_K to 8 bits, Q2_K and Q3_K to 4), 4% measured.
AS_STORED = [
    {"q": Q.Q4_K, "k": Q.Q5_K, "v": Q.Q8_0, "o": Q.Q4_K, "gate": Q.Q5_0, "up": Q.Q5_1},
    {"q": Q.Q4_0, "k": Q.Q4_1, "v": Q.Q4_K, "o": Q.Q5_K, "gate": Q.Q4_K, "up": Q.Q8_0},
]
ROUNDED_AGAIN = [AS_STORED[0] | {"v": Q.Q6_K}, AS_STORED[1] | {"q": Q.Q3_K, "k": Q.Q2_K}]
# name: (each layer's q/k/v/o/gate/up types, each layer's down_proj type, embeddings, tolerance)
MIXES = {
    "as-stored": (AS_STORED, [Q.Q5_K, Q.Q4_K], Q.Q8_0, 0.005),
    "rounded-again": (ROUNDED_AGAIN, [Q.Q6_K, Q.Q4_K], Q.Q6_K, 0.1),
}


@pytest.fixture(scope="module", params=list(MIXES))
def kquant_file(request, tmp_path_factory) -> tuple[Path, float]:
    """A tiny Llama file of one of MIXES, and its tolerance."""
    layer_types, down_types, embed_type, tolerance = MIXES[request.param]
    weights = hf_weights(head_dim=HEAD_DIM, hidden=HIDDEN, ffn=FFN)
    types = {"model.embed_tokens.weight": embed_type}  # tied: the LM head too
    for i, layer in enumerate(layer_types):
        for part, qtype in layer.items():
            block = "mlp" if part in ("gate", "up") else "self_attn"
            types[f"model.layers.{i}.{block}.{part}_proj.weight"] = qtype
        types[f"model.layers.{i}.mlp.down_proj.weight"] = down_types[i]
    dims = {
        "llama.embedding_length": HIDDEN,
        "llama.feed_forward_length": FFN,
        "llama.attention.key_length": HEAD_DIM,
        "llama.rope.dimension_count": HEAD_DIM,
    }
    assert HIDDEN == HEADS * HEAD_DIM
    path = tmp_path_factory.mktemp("kquant") / f"{request.param}.gguf"
    return write_gguf(path, weights, metadata=dims, raw=types, encode=random_blocks), tolerance


def tinyllm_model(path: Path, keep_stored: bool = True) -> Transformer:
    """The model as LLM(quantization="auto") builds it, each tensor at its own bits; without
    `keep_stored`, as quantization="int4" does."""
    return load(path, quantization="auto" if keep_stored else "int4")


def test_forced_int4_rounds_8bit_tensors_to_4_bits(kquant_file: tuple[Path, float]):
    model = tinyllm_model(kquant_file[0], keep_stored=False)
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.bits == 4 and layer.mlp.gate_up_proj.bits == 4
    assert model.lm_head.bits == 8


def test_kquant_file_matches_transformers(kquant_file: tuple[Path, float]):
    from transformers import AutoModelForCausalLM

    kquant_file, tolerance = kquant_file
    reference = AutoModelForCausalLM.from_pretrained(
        kquant_file.parent, gguf_file=kquant_file.name, dtype=torch.float32
    ).eval()
    model = tinyllm_model(kquant_file)
    layer = model.model.layers[0]
    # Q5_0 gate and Q5_1 up stay 8-bit, the mixed q/k/v too (8-bit v): none rounded to 4 bits.
    assert layer.self_attn.qkv_proj.bits == 8 and layer.mlp.gate_up_proj.bits == 8
    assert model.model.layers[1].mlp.down_proj.bits == 4  # Q4_K as stored
    ids = [5, 17, 99, 3, 64]
    for _ in range(8):  # greedy, each side on its own tokens
        (logits,) = prompt_logits(model, [ids])
        with torch.inference_mode():
            expected = reference(torch.tensor([ids])).logits[0]
        atol = tolerance * expected.std().item()
        torch.testing.assert_close(logits, expected, rtol=0, atol=atol)
        # The same greedy token, except where transformers' top two are closer than the
        # logits' tolerance allows to tell apart.
        top2 = expected.topk(2).values
        clear = top2[:, 0] - top2[:, 1] > 2 * atol
        assert clear[-1] or top2[-1, 0] - expected[-1, logits[-1].argmax()] <= 2 * atol
        assert logits.argmax(-1)[clear].equal(expected.argmax(-1)[clear])
        ids.append(int(logits[-1].argmax()))


# ---- files tinyllm cannot run: one line naming the problem ----


@pytest.mark.parametrize(
    ("arch", "qtype", "message"),
    [
        ("llama", Q.IQ2_XXS, "'blk.1.ffn_down.weight' has unsupported type IQ2_XXS"),
        ("gpt2", Q.Q4_K, "GGUF architecture 'gpt2' is not supported"),
    ],
)
def test_unsupported_file_is_one_line(tmp_path: Path, capsys, arch: str, qtype: Q, message: str):
    raw = {"model.layers.1.mlp.down_proj.weight": qtype}
    path = write_gguf(tmp_path / "m.gguf", hf_weights(), arch, raw=raw)
    assert cli.main(["generate", "hi", "--model", str(path)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("tinyllm: error:")]
    assert message in line and str(path) in line, err


def test_scales_beyond_fp16_are_refused(tmp_path: Path):
    """Q4_K's d * sc is computed in fp32: a large d times a 6-bit scale has no fp16 to pack."""

    def huge(shape, qtype, rng):
        blocks = random_blocks(shape, qtype, rng)
        flat = blocks.reshape(-1, gguf.GGML_QUANT_SIZES[qtype][1])
        flat[:, 0:2] = np.array([60000], np.float16).view(np.uint8)  # d
        flat[:, 4] = 63  # sub-block 0's scale
        return blocks

    name = "model.layers.1.mlp.down_proj.weight"
    path = write_gguf(tmp_path / "m.gguf", hf_weights(), raw={name: Q.Q4_K}, encode=huge)
    load(path)  # dequantized, as fp32, it loads
    with pytest.raises(ModelLoadError, match=r"'blk.1.ffn_down.weight': Q4_K blocks whose scale"):
        load(path, quantization="auto")
