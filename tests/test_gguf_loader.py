from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from tests.model_runs import checkpoint_weights, load
from tinyllm.loaders import model_loader
from tinyllm.loaders.gguf import gguf_config, open_gguf
from tinyllm.model.config import ModelLoadError, UnsupportedModelError

Q = gguf.GGMLQuantizationType
LAYERS, HIDDEN, HEADS, KV_HEADS, FFN, VOCAB = 2, 64, 4, 2, 256, 128

# Hugging Face name suffix -> llama.cpp tensor name suffix, as llama.cpp's converter writes them.
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    # Phi-3's stacked projections (arch "phi3")
    "self_attn.qkv_proj.weight": "attn_qkv.weight",
    "mlp.gate_up_proj.weight": "ffn_up.weight",
}
TOP_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_name(hf_name: str) -> str:
    if hf_name in TOP_NAMES:
        return TOP_NAMES[hf_name]
    _, _, i, suffix = hf_name.split(".", 3)
    return f"blk.{i}.{LAYER_NAMES[suffix]}"


def hf_weights(
    head_dim: int = HIDDEN // HEADS,
    tied: bool = True,
    bias: bool = False,
    qk_norm: bool = False,
    hidden: int = HIDDEN,
    ffn: int = FFN,
) -> dict[str, np.ndarray]:
    """Random weights; a `hidden` or `ffn` other than the defaults needs them in write_gguf's
    metadata too."""
    rng = np.random.default_rng(0)
    shapes = {"model.embed_tokens.weight": (VOCAB, hidden), "model.norm.weight": (hidden,)}
    if not tied:
        shapes["lm_head.weight"] = (VOCAB, hidden)
    q, kv = HEADS * head_dim, KV_HEADS * head_dim
    for i in range(LAYERS):
        layer = {
            "input_layernorm.weight": (hidden,),
            "self_attn.q_proj.weight": (q, hidden),
            "self_attn.k_proj.weight": (kv, hidden),
            "self_attn.v_proj.weight": (kv, hidden),
            "self_attn.o_proj.weight": (hidden, q),
            "post_attention_layernorm.weight": (hidden,),
            "mlp.gate_proj.weight": (ffn, hidden),
            "mlp.up_proj.weight": (ffn, hidden),
            "mlp.down_proj.weight": (hidden, ffn),
        }
        for proj, rows in [("q", q), ("k", kv), ("v", kv)] if bias else []:
            layer[f"self_attn.{proj}_proj.bias"] = (rows,)
        for proj in ["q", "k"] if qk_norm else []:
            layer[f"self_attn.{proj}_norm.weight"] = (head_dim,)
        shapes |= {f"model.layers.{i}.{name}": shape for name, shape in layer.items()}
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to llama q/k rows (LlamaModel.permute)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_gguf(
    path: Path,
    weights: dict[str, np.ndarray],
    arch: str = "llama",
    qtype: Q = Q.F32,
    metadata: dict | None = None,
    raw: dict[str, Q] | None = None,
    extra_tensors: dict[str, np.ndarray | tuple[np.ndarray, Q]] | None = None,
    encode=None,
) -> Path:
    """A tiny model file, with a vocabulary of VOCAB tokens for its tokenizer. 2-D weights are
    stored as `qtype` (norms and biases stay F32, as in llama.cpp); tensors named in `raw` get
    blocks of the given type instead: `encode(shape, type, rng)`'s bytes, by default random
    ones. A `metadata` value of None leaves the key out. `extra_tensors`: more by their GGUF
    names, as they are, or (values, type) quantized to that type."""
    writer = gguf.GGUFWriter(path, arch)
    values = {
        f"{arch}.block_count": LAYERS,
        f"{arch}.context_length": 256,
        f"{arch}.embedding_length": HIDDEN,
        f"{arch}.feed_forward_length": FFN,
        f"{arch}.attention.head_count": HEADS,
        f"{arch}.attention.head_count_kv": KV_HEADS,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-5,
        f"{arch}.rope.freq_base": 10000.0,
        f"{arch}.vocab_size": VOCAB,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": [f"t{i}" for i in range(VOCAB)],
    } | (metadata or {})
    for key, value in values.items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, list):
            writer.add_array(key, value)
        elif value is not None:
            writer.add_uint32(key, value)
    rng = np.random.default_rng(1)
    for hf_name, w in weights.items():
        name = gguf_name(hf_name)
        if arch == "llama" and ".attn_q." in name:
            w = llama_cpp_permute(w, HEADS)
        elif arch == "llama" and ".attn_k." in name:
            w = llama_cpp_permute(w, KV_HEADS)
        if raw and hf_name in raw and encode:
            writer.add_tensor(name, encode(w.shape, raw[hf_name], rng), raw_dtype=raw[hf_name])
        elif raw and hf_name in raw:
            blocks = rng.integers(
                0, 256, gguf.quants.quant_shape_to_byte_shape(w.shape, raw[hf_name])
            )
            # Every f16 scale in these block formats sits at an even offset: capping the high
            # byte keeps it finite (|scale| < 2), so the decoded values are too.
            blocks[..., 1::2] &= 0x3F
            writer.add_tensor(name, blocks.astype(np.uint8), raw_dtype=raw[hf_name])
        elif w.ndim == 1 or qtype == Q.F32:
            writer.add_tensor(name, w)
        elif qtype == Q.F16:
            writer.add_tensor(name, w.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    for name, w in (extra_tensors or {}).items():
        if isinstance(w, tuple):
            writer.add_tensor(name, gguf.quants.quantize(*w), raw_dtype=w[1])
        else:
            writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# ---- the default model, against transformers' own GGUF loader ----


@pytest.fixture(scope="module")
def default_reader(default_gguf_path: Path) -> gguf.GGUFReader:
    return open_gguf(default_gguf_path)


def test_default_model_config(default_reader: gguf.GGUFReader):
    config = gguf_config(default_reader)
    assert config.architecture == "llama"
    assert (config.num_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (9, 3, 64)
    assert config.vocab_size == 49152
    assert config.tie_word_embeddings and not config.attention_bias and not config.qk_norm
    assert config.rope_theta == 100000.0 and config.rope_scaling is None
    assert config.rms_norm_eps == 1e-5
    assert config.max_position_embeddings == 8192


@pytest.fixture(scope="module")
def default_weights(default_gguf_path: Path) -> dict[str, torch.Tensor]:
    return checkpoint_weights(load(default_gguf_path))


@pytest.mark.slow
def test_default_weights_match_transformers(default_gguf_path: Path, default_weights):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        default_gguf_path.parent, gguf_file=default_gguf_path.name, dtype=torch.float32
    )
    expected = model.state_dict()
    assert set(expected) - set(default_weights) == {"lm_head.weight"}  # tied: no copy of ours
    assert set(default_weights) <= set(expected)
    for name, w in default_weights.items():
        assert w.dtype == torch.float32
        torch.testing.assert_close(w, expected[name], atol=1e-6, rtol=0, msg=name)


# ---- tiny files written here ----

# Worst-case error of each format relative to the largest |value| in the tensor: half a step
# for the float formats, a full step for the symmetric block formats (which clip one side).
MAX_RELATIVE_ERROR = {
    Q.F32: 0.0,
    Q.F16: 2**-11,
    Q.BF16: 2**-8,
    Q.Q8_0: 1 / 127,
    Q.Q5_1: 1 / 31,
    Q.Q5_0: 1 / 16,
    Q.Q4_1: 1 / 15,
    Q.Q4_0: 1 / 8,
}


@pytest.mark.parametrize("qtype", list(MAX_RELATIVE_ERROR), ids=lambda q: q.name)
def test_quantized_tiny_llama_round_trip(tmp_path: Path, qtype: Q):
    originals = hf_weights()
    weights = checkpoint_weights(load(write_gguf(tmp_path / "m.gguf", originals, qtype=qtype)))
    assert set(weights) == set(originals)
    for name, original in originals.items():
        # Blocks run along rows and the q/k permutation moves whole rows, so un-permuting
        # after dequantization must give exactly the library's dequantization of the original.
        exact = original
        if original.ndim == 2:
            exact = gguf.quants.dequantize(gguf.quants.quantize(original, qtype), qtype)
        assert weights[name].shape == original.shape, name
        assert torch.equal(weights[name], torch.from_numpy(np.asarray(exact, np.float32))), name
        error = np.abs(weights[name].numpy() - original).max()
        assert error <= MAX_RELATIVE_ERROR[qtype] * np.abs(original).max() + 1e-7, name


def test_qk_permutation_round_trip_llama_with_bias(tmp_path: Path):
    originals = hf_weights(bias=True)
    path = write_gguf(tmp_path / "m.gguf", originals)
    stored = {t.name: np.asarray(t.data) for t in open_gguf(path).tensors}
    # The file really holds permuted rows, so a loader that forgot to undo it would fail below.
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not np.array_equal(stored["blk.0.attn_q.weight"], originals[q])
    assert not np.array_equal(stored["blk.0.attn_k.bias"], originals[q.replace("q_proj", "k_proj")])
    model = load(path)
    weights = checkpoint_weights(model)
    assert model.config.attention_bias
    for name, original in originals.items():
        assert torch.equal(weights[name], torch.from_numpy(original)), name


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_is_not_permuted(tmp_path: Path, arch: str):
    qwen3 = arch == "qwen3"
    head_dim = 32 if qwen3 else HIDDEN // HEADS  # Qwen3 heads are wider than hidden / heads
    originals = hf_weights(head_dim=head_dim, tied=False, bias=not qwen3, qk_norm=qwen3)
    metadata = {f"{arch}.attention.key_length": head_dim} if qwen3 else {}
    path = write_gguf(tmp_path / "m.gguf", originals, arch, metadata=metadata)
    model = load(path)
    config, weights = model.config, checkpoint_weights(model)
    assert config.architecture == arch and config.head_dim == head_dim
    assert config.attention_bias == (not qwen3) and config.qk_norm == qwen3
    assert not config.tie_word_embeddings
    assert set(weights) == set(originals)
    for name, original in originals.items():
        assert torch.equal(weights[name], torch.from_numpy(original)), name


@pytest.mark.parametrize("qtype", [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda q: q.name)
def test_k_quants_dequantize_like_the_library(tmp_path: Path, qtype: Q):
    # The gguf package cannot quantize K-quants, so store random blocks: down_proj rows hold
    # FFN = 256 values, one K-quant super-block.
    name = "model.layers.1.mlp.down_proj.weight"
    path = write_gguf(tmp_path / "m.gguf", hf_weights(), raw={name: qtype})
    reader = open_gguf(path)
    stored = next(t for t in reader.tensors if t.name == "blk.1.ffn_down.weight")
    assert stored.tensor_type == qtype
    weights = checkpoint_weights(load(path))
    expected = torch.from_numpy(gguf.quants.dequantize(stored.data, qtype))
    assert weights[name].shape == (HIDDEN, FFN)
    assert torch.isfinite(expected).all()
    assert torch.equal(weights[name], expected)


def test_dtype_is_applied(tmp_path: Path):
    path = write_gguf(tmp_path / "m.gguf", hf_weights(), qtype=Q.Q8_0)
    full = checkpoint_weights(load(path))
    bf16 = checkpoint_weights(load(path, dtype="bfloat16"))
    assert all(w.dtype == torch.bfloat16 for w in bf16.values())
    assert all(torch.equal(bf16[name], w.to(torch.bfloat16)) for name, w in full.items())


@pytest.mark.parametrize("threshold", [1, 2**40])
def test_progress_only_for_big_files(tmp_path: Path, capfd, monkeypatch, threshold: int):
    """A file at least PROGRESS_BYTES long shows its tensors' progress on stderr; a smaller one
    (the default model's, in every test) loads silently."""
    path = write_gguf(tmp_path / "m.gguf", hf_weights(), qtype=Q.Q4_0)
    monkeypatch.setattr(model_loader, "PROGRESS_BYTES", threshold)
    load(path, quantization="auto")
    out, err = capfd.readouterr()
    assert not out
    assert ("loading weights: 100%" in err) == (threshold == 1)
    assert ("tensor" in err) == (threshold == 1)


def test_metadata_defaults_and_vocab_fallbacks(tmp_path: Path):
    unset = {
        "llama.attention.head_count_kv": None,
        "llama.rope.freq_base": None,
        "llama.vocab_size": None,
        "tokenizer.ggml.tokens": None,
    }
    config = gguf_config(open_gguf(write_gguf(tmp_path / "a.gguf", hf_weights(), metadata=unset)))
    assert config.num_kv_heads == HEADS
    assert config.rope_theta == 10000.0
    assert config.vocab_size == VOCAB  # the rows of token_embd.weight
    assert config.head_dim == HIDDEN // HEADS
    assert config.rms_norm_eps == 1e-5 and config.max_position_embeddings == 256

    path = tmp_path / "b.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    for key, value in [("block_count", 1), ("context_length", 64), ("embedding_length", 64)]:
        writer.add_uint32(f"llama.{key}", value)
    writer.add_uint32("llama.feed_forward_length", 128)
    writer.add_uint32("llama.attention.head_count", 4)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_token_list([f"t{i}" for i in range(77)])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    assert gguf_config(open_gguf(path)).vocab_size == 77


@pytest.mark.parametrize(
    ("metadata", "expected"),
    [
        (
            {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0},
            {"rope_type": "linear", "factor": 4.0},
        ),
        (
            {
                "llama.rope.scaling.type": "yarn",
                "llama.rope.scaling.factor": 4.0,
                "llama.rope.scaling.original_context_length": 32768,
                "llama.rope.scaling.yarn_beta_fast": 16.0,
            },
            # beta_slow and the ramp's truncation as llama.cpp has them
            {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32768,
                "beta_fast": 16.0,
                "beta_slow": 1.0,
                "truncate": True,
            },  # fmt: skip
        ),
        ({"llama.rope.scaling.type": "none"}, None),
    ],
)
def test_rope_scaling_metadata(tmp_path: Path, metadata: dict, expected: dict | None):
    path = write_gguf(tmp_path / "m.gguf", hf_weights(), metadata=metadata)
    assert gguf_config(open_gguf(path)).rope_scaling == expected


@pytest.mark.parametrize(
    "scaling",
    [
        {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},  # Llama 3.1
        {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},  # Llama 3.2
        {"factor": 16.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0},
    ],
)
def test_llama3_rope_scaling_from_rope_freqs(tmp_path: Path, scaling: dict):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    head_dim, theta = 128, 500000.0

    def hf_inv_freq(rope_scaling: dict) -> torch.Tensor:
        parameters = {"rope_type": "llama3", "rope_theta": theta, **rope_scaling}
        parameters.setdefault("original_max_position_embeddings", 8192)
        config = LlamaConfig(
            hidden_size=HIDDEN,
            num_attention_heads=HEADS,
            head_dim=head_dim,
            max_position_embeddings=131072,
            rope_parameters=parameters,
        )
        return ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")[0].double()

    # llama.cpp stores the divisor that turns each plain frequency into the scaled one.
    plain = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    divisors = (plain / hf_inv_freq(scaling)).float().numpy()
    metadata = {"llama.attention.key_length": head_dim, "llama.rope.freq_base": theta}
    path = write_gguf(
        tmp_path / "m.gguf",
        hf_weights(head_dim=head_dim),
        metadata=metadata,
        extra_tensors={"rope_freqs.weight": divisors},
    )
    model = load(path)
    config, weights = model.config, checkpoint_weights(model)
    assert "rope_freqs.weight" not in weights and len(weights) == len(hf_weights())
    assert config.rope_scaling["rope_type"] == "llama3"
    for key, value in scaling.items():
        assert config.rope_scaling[key] == pytest.approx(value, rel=1e-5), key
    torch.testing.assert_close(
        hf_inv_freq(config.rope_scaling), hf_inv_freq(scaling), rtol=1e-6, atol=0
    )


# ---- bad input ----


def test_missing_file(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        open_gguf(tmp_path / "nope.gguf")


@pytest.mark.parametrize(
    "content", [b"", np.random.default_rng(0).bytes(4096)], ids=["empty", "random"]
)
def test_not_a_gguf_file(tmp_path: Path, content: bytes):
    path = tmp_path / "junk.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelLoadError, match=r"junk\.gguf.*bad magic"):
        open_gguf(path)


def test_corrupt_header(tmp_path: Path):
    path = tmp_path / "m.gguf"
    data = write_gguf(path, hf_weights()).read_bytes()
    path.write_bytes(data[:24] + b"\xff" * 40 + data[64:])  # counts ok, first key mangled
    with pytest.raises(ModelLoadError, match=r"m\.gguf: corrupt GGUF header"):
        open_gguf(path)


def test_truncated_in_tensor_data(tmp_path: Path):
    path = write_gguf(tmp_path / "m.gguf", hf_weights())
    tensors = open_gguf(path).tensors
    cut = (tensors[0].data_offset + tensors[-1].data_offset) // 2
    victim = next(t for t in tensors if t.data_offset + t.n_bytes > cut)
    path.write_bytes(path.read_bytes()[:cut])
    missing = victim.data_offset + victim.n_bytes - cut
    message = f"truncated: tensor '{victim.name}' needs {missing} bytes past end of file"
    with pytest.raises(ModelLoadError, match=rf"m\.gguf: {message}"):
        open_gguf(path)


def test_unsupported_architecture(tmp_path: Path):
    path = write_gguf(tmp_path / "m.gguf", {}, arch="gpt2")
    with pytest.raises(UnsupportedModelError, match="GGUF architecture 'gpt2' is not supported"):
        gguf_config(open_gguf(path))


def test_experts_of_an_architecture_without_them_are_rejected(tmp_path: Path):
    """Experts run for llama (Mixtral), qwen3moe and olmoe (tests/test_moe_models.py)."""
    metadata = {"qwen2.expert_count": 8}
    path = write_gguf(tmp_path / "m.gguf", hf_weights(), "qwen2", metadata=metadata)
    with pytest.raises(UnsupportedModelError, match="qwen2 with experts is not supported"):
        gguf_config(open_gguf(path))


def test_missing_metadata(tmp_path: Path):
    path = write_gguf(tmp_path / "m.gguf", hf_weights(), metadata={"llama.block_count": None})
    with pytest.raises(ModelLoadError, match=r"m\.gguf: GGUF metadata lacks 'llama.block_count'"):
        gguf_config(open_gguf(path))


@pytest.mark.parametrize("qtype", [Q.IQ2_XXS, Q.I8], ids=lambda q: q.name)
def test_unsupported_tensor_type(tmp_path: Path, qtype: Q):
    name = "model.layers.1.mlp.down_proj.weight"
    path = write_gguf(tmp_path / "m.gguf", hf_weights(), raw={name: qtype})
    with pytest.raises(UnsupportedModelError, match=rf"'blk.1.ffn_down.weight'.*type {qtype.name}"):
        load(path)


def test_tensor_type_unknown_to_gguf(tmp_path: Path):
    path = write_gguf(tmp_path / "m.gguf", hf_weights())
    reader = gguf.GGUFReader(path, "r+")
    reader.tensors[3].field.parts[4][0] = 200  # the tensor-type number of the 4th tensor
    reader.data.flush()
    name = reader.tensors[3].name
    del reader
    with pytest.raises(UnsupportedModelError, match=rf"tensor '{name}' has tensor type 200"):
        open_gguf(path)


def test_missing_unexpected_and_misshapen_tensors(tmp_path: Path):
    originals = hf_weights()
    del originals["model.layers.1.mlp.up_proj.weight"]
    path = write_gguf(tmp_path / "a.gguf", originals)
    with pytest.raises(ModelLoadError, match="missing tensors model.layers.1.mlp.up_proj.weight"):
        load(path)

    extra = {"blk.0.ffn_gate_inp.weight": np.zeros((8, HIDDEN), np.float32)}
    path = write_gguf(tmp_path / "b.gguf", hf_weights(), extra_tensors=extra)
    with pytest.raises(
        UnsupportedModelError, match="unexpected tensor 'blk.0.ffn_gate_inp.weight'"
    ):
        load(path)

    path = write_gguf(
        tmp_path / "c.gguf", hf_weights(), metadata={"llama.feed_forward_length": 128}
    )
    with pytest.raises(ModelLoadError, match=r"'blk.0.ffn_gate.weight' has shape \(256, 64\)"):
        load(path)
