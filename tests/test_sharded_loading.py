"""Tensor-parallel loading (loaders/sharding.py): each rank's model holds its slice of every
weight of the world_size=1 model, read without the rest, in every format (safetensors, GGUF's
stored 4- and 8-bit blocks and K-quants, dummy weights), dense or quantized; together the ranks'
slices are the whole weight; a split that does not fall on heads or groups is refused."""

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from tests.gguf_encoders import random_blocks
from tests.test_gguf_loader import LAYERS, VOCAB, write_gguf
from tests.test_hf_loader import _write_tokenizer
from tinyllm.loaders.gguf import gguf_config, gguf_tensors
from tinyllm.loaders.model_loader import LoadConfig, load_model
from tinyllm.loaders.sharding import Shard, param_loader
from tinyllm.loaders.source import open_checkpoint
from tinyllm.model.config import ModelConfig
from tinyllm.model.quant import QuantLinear, unpack

Q = gguf.GGMLQuantizationType
CPU = torch.device("cpu")
COLUMN = ("self_attn.qkv_proj", "mlp.gate_up_proj")
ROW = ("self_attn.o_proj", "mlp.down_proj")


def random_llama(hidden, heads, kv_heads, head_dim, ffn, bias=False, tied=True) -> dict:
    """HF-named random weights of a LAYERS-layer Llama (Qwen2 with `bias`)."""
    rng = np.random.default_rng(0)
    q, kv = heads * head_dim, kv_heads * head_dim
    shapes = {"model.embed_tokens.weight": (VOCAB, hidden), "model.norm.weight": (hidden,)}
    if not tied:
        shapes["lm_head.weight"] = (VOCAB, hidden)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (q, hidden),
            p + "self_attn.k_proj.weight": (kv, hidden),
            p + "self_attn.v_proj.weight": (kv, hidden),
            p + "self_attn.o_proj.weight": (hidden, q),
            p + "mlp.gate_proj.weight": (ffn, hidden),
            p + "mlp.up_proj.weight": (ffn, hidden),
            p + "mlp.down_proj.weight": (hidden, ffn),
        }
        for proj, rows in [("q", q), ("k", kv), ("v", kv)] if bias else []:
            shapes[p + f"self_attn.{proj}_proj.bias"] = (rows,)
    return {name: rng.standard_normal(s).astype(np.float32) * 0.1 for name, s in shapes.items()}


def write_config(path: Path, arch: str, dims: dict, tied: bool = True) -> Path:
    """A Hugging Face config.json of `dims`, at `path`."""
    config = {
        "model_type": arch,
        "vocab_size": VOCAB,
        "hidden_size": dims["hidden"],
        "intermediate_size": dims["ffn"],
        "num_hidden_layers": LAYERS,
        "num_attention_heads": dims["heads"],
        "num_key_value_heads": dims["kv_heads"],
        "head_dim": dims["head_dim"],
        "max_position_embeddings": 64,
        "tie_word_embeddings": tied,
    }
    path.write_text(json.dumps(config))
    return path


def hf_dir(folder: Path, arch: str, dims: dict, tied: bool = True) -> Path:
    """A safetensors model directory (Qwen2's with q/k/v biases), with a tokenizer."""
    path = folder / arch
    path.mkdir()
    weights = random_llama(**dims, bias=arch == "qwen2", tied=tied)
    save_file({k: torch.from_numpy(v) for k, v in weights.items()}, path / "model.safetensors")
    write_config(path / "config.json", arch, dims, tied)
    _write_tokenizer(path)
    return path


def gguf_file(folder: Path, dims: dict, types: dict[str, Q]) -> Path:
    """A tiny llama GGUF whose layers' projections are stored as `types` (by HF part name:
    q, k, v, o, gate, up, down), written as llama.cpp would (q/k rows permuted)."""
    raw = {}
    for i in range(LAYERS):
        for part, qtype in types.items():
            block = "mlp" if part in ("gate", "up", "down") else "self_attn"
            raw[f"model.layers.{i}.{block}.{part}_proj.weight"] = qtype
    metadata = {
        "llama.embedding_length": dims["hidden"],
        "llama.feed_forward_length": dims["ffn"],
        "llama.attention.head_count": dims["heads"],
        "llama.attention.head_count_kv": dims["kv_heads"],
        "llama.attention.key_length": dims["head_dim"],
        "llama.rope.dimension_count": dims["head_dim"],
    }
    weights = random_llama(**dims)
    return write_gguf(folder / "m.gguf", weights, metadata=metadata, raw=raw, encode=random_blocks)


# Heads, KV heads and FFN width divide by 4, and each rank's share of o_proj's and down_proj's
# inputs is whole groups of 32 at world_size 4.
SMALL = dict(hidden=64, heads=8, kv_heads=4, head_dim=16, ffn=128)
# K-quant rows are whole super-blocks of 256; at world_size 2 and 4 a rank's share of
# down_proj's inputs starts inside one.
KQUANT = dict(hidden=256, heads=4, kv_heads=4, head_dim=64, ffn=256)
K_TYPES = dict(q=Q.Q4_K, k=Q.Q5_K, v=Q.Q6_K, o=Q.Q8_0, gate=Q.Q4_1, up=Q.Q3_K, down=Q.Q4_K)
BLOCK_TYPES = dict(q=Q.Q4_0, k=Q.Q4_1, v=Q.Q8_0, o=Q.Q4_1, gate=Q.Q5_0, up=Q.Q4_1, down=Q.Q5_1)

CASES = {  # name: (writes the model into a folder and says how to load it, quantization)
    "safetensors-dense": (lambda p: (hf_dir(p, "llama", SMALL, tied=False), "auto"), "none"),
    "safetensors-int4": (lambda p: (hf_dir(p, "llama", SMALL, tied=False), "auto"), "int4"),
    "safetensors-qwen2-bias-int8": (lambda p: (hf_dir(p, "qwen2", SMALL), "auto"), "int8"),
    "gguf-blocks": (lambda p: (gguf_file(p, SMALL, BLOCK_TYPES), "auto"), "auto"),
    "gguf-kquants": (lambda p: (gguf_file(p, KQUANT, K_TYPES), "auto"), "auto"),
    "gguf-kquants-dense": (lambda p: (gguf_file(p, KQUANT, K_TYPES), "auto"), "none"),
    "dummy-int4": (lambda p: (write_config(p / "config.json", "qwen2", SMALL), "dummy"), "auto"),
}


def dense_linears(net: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each linear layer's weight (and the qkv bias) as dense fp32, unpacked where quantized."""
    out = {}
    for name, m in net.named_modules():
        if isinstance(m, QuantLinear):
            out[name] = unpack(m.packed, m.bits)[: m.out_features, : m.in_features]
        elif isinstance(m, torch.nn.Linear):
            out[name] = m.weight.float()
        if name.endswith("qkv_proj") and m.bias is not None:
            out[name + ".bias"] = m.bias.float()
    return out


def column_parts(config: ModelConfig, name: str) -> list[int]:
    """The rows of each part a column-parallel layer stacks (q, k, v or gate, up)."""
    if "qkv_proj" in name:
        q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        return [q, kv, kv]
    return [config.intermediate_size] * 2


def expected_shard(full: torch.Tensor, name: str, config, rank: int, ws: int) -> torch.Tensor:
    """The slice of the world_size=1 weight that rank `rank` of `ws` holds."""
    if name.endswith(ROW):
        return full.chunk(ws, dim=1)[rank]
    if name.endswith(COLUMN) or name.endswith("qkv_proj.bias"):
        parts = full.split(column_parts(config, name))
        return torch.cat([part.chunk(ws)[rank] for part in parts])
    return full  # replicated


def reassembled(shards: list[torch.Tensor], name: str, config, ws: int) -> torch.Tensor:
    """The whole weight put back together from the ranks' shards."""
    if name.endswith(ROW):
        return torch.cat(shards, dim=1)
    if name.endswith(COLUMN) or name.endswith("qkv_proj.bias"):
        local = [n // ws for n in column_parts(config, name)]
        by_rank = [s.split(local) for s in shards]
        return torch.cat([torch.cat([parts[i] for parts in by_rank]) for i in range(len(local))])
    assert all(torch.equal(s, shards[0]) for s in shards)
    return shards[0]


def load(model: Path, quantization: str, rank: int = 0, ws: int = 1, fmt: str = "auto"):
    config = LoadConfig(str(model), "float32", quantization, fmt, max_model_len=64)
    return load_model(config, CPU, rank, ws).model


def sharded(name: str) -> bool:
    return any(f".{layer}." in name for layer in COLUMN + ROW)


@pytest.mark.parametrize("case", CASES)
def test_each_rank_holds_its_slice_and_the_ranks_make_the_whole(case, tmp_path):
    write, quantization = CASES[case]
    model, fmt = write(tmp_path)
    whole = load(model, quantization, fmt=fmt)
    full, config = dense_linears(whole), whole.config
    assert any(isinstance(m, QuantLinear) for m in whole.modules()) == (quantization != "none")
    for ws in (2, 4):
        ranks = [load(model, quantization, r, ws, fmt) for r in range(ws)]
        for r, net in enumerate(ranks):
            c = net.config
            assert (c.num_heads, c.num_kv_heads, c.intermediate_size, c.tensor_parallel_size) == (
                config.num_heads // ws,
                config.num_kv_heads // ws,
                config.intermediate_size // ws,
                ws,
            )
            assert net.model.layers[0].self_attn.n_kv == config.num_kv_heads // ws
            mine = dense_linears(net)
            assert mine.keys() == full.keys()
            for name, w in mine.items():
                want = expected_shard(full[name], name, config, r, ws)
                assert torch.equal(w, want), name
            for name, p in net.named_parameters():  # norms and embeddings: replicated
                assert sharded(name) or torch.equal(p, whole.get_parameter(name)), name
        for name, w in full.items():
            shards = [dense_linears(net)[name] for net in ranks]
            assert torch.equal(reassembled(shards, name, config, ws), w), name


def test_a_rank_multiplies_its_part_of_the_product(tmp_path):
    """Run as the tensor-parallel runtime will: a rank's qkv_proj gives its heads' columns of
    the whole product, and the ranks' o_proj products add up to the whole one."""
    path, ws = gguf_file(tmp_path, SMALL, BLOCK_TYPES), 2
    whole = load(path, "auto")
    ranks = [load(path, "auto", r, ws) for r in range(ws)]
    x = torch.randn(5, SMALL["hidden"], generator=torch.Generator().manual_seed(0))
    attn = whole.model.layers[1].self_attn
    heads_out = torch.randn(5, attn.o_proj.in_features, generator=torch.Generator().manual_seed(1))
    partial = []
    for r, net in enumerate(ranks):
        mine = net.model.layers[1].self_attn
        want = expected_shard(attn.qkv_proj(x).T, "self_attn.qkv_proj", whole.config, r, ws)
        assert torch.equal(mine.qkv_proj(x), want.T)
        partial.append(mine.o_proj(heads_out.chunk(ws, dim=1)[r].contiguous()))
    # A rank's inputs are whole groups of 32, which the kernel quantizes as the whole layer
    # does: only the order of the sum differs.
    torch.testing.assert_close(sum(partial), attn.o_proj(heads_out), rtol=1e-5, atol=1e-5)


def test_uneven_splits_are_refused_with_the_counts(tmp_path):
    (tmp_path / "kv2").mkdir()
    path = hf_dir(tmp_path / "kv2", "llama", SMALL | dict(kv_heads=2, heads=4))
    with pytest.raises(ValueError, match="num_kv_heads 2 do not divide by world_size 4"):
        load(path, "none", 0, 4)
    # o_proj's 64 inputs split 4 ways give each rank 16: half a group of 32.
    (tmp_path / "narrow").mkdir()
    path = hf_dir(tmp_path / "narrow", "llama", SMALL | dict(heads=4))
    with pytest.raises(
        ValueError,
        match=r"model.layers.0.self_attn.o_proj.weight: its input columns \(64\) do not split "
        r"over world_size 4 in whole groups of 32",
    ):
        load(path, "int4", 1, 4)
    assert load(path, "none", 1, 4).model.layers[0].self_attn.o_proj.in_features == 16
    with pytest.raises(ValueError, match="rank 2 is not in 0..world_size-1 \\(2\\)"):
        load(path, "none", 2, 2)


def test_a_column_split_keeps_heads_whole():
    """Used on its own, a loader refuses rows that divide but would cut a head in two."""
    config = ModelConfig("llama", VOCAB, 64, 128, 1, 3, 3, 16, 64)
    loader = param_loader("model.layers.0.self_attn.qkv_proj.weight", config, quantized=False)
    with pytest.raises(ValueError, match=r"\(q\): its rows \(48\) do not split over world_size 2"):
        loader.load({}, Shard(0, 2))
    config = ModelConfig("llama", VOCAB, 64, 128, 1, 2, 2, 24, 64)
    loader = param_loader("model.layers.0.self_attn.qkv_proj.weight", config, quantized=False)
    with pytest.raises(ValueError, match=r"\(48\) do not split .* 4 in whole heads of 24 rows"):
        loader.load({}, Shard(0, 4))


def test_default_model_splits_three_ways_as_stored(default_gguf_path):
    """The default model's Q4_1 blocks (9 query and 3 KV heads, q/k rows permuted by llama.cpp)
    read by each of 3 ranks: each rank's groups are its slice of the whole file's, bit for bit,
    reading only its own blocks."""
    checkpoint = open_checkpoint(str(default_gguf_path), keep_quantized=True)
    config = checkpoint.config
    for layer in [f"model.layers.7.{name}" for name in COLUMN + ROW]:
        loader = param_loader(f"{layer}.weight", config, quantized=True)
        whole = loader.load(checkpoint.tensors, Shard(0, 1)).dequantize()
        for r in range(3):
            mine = loader.load(checkpoint.tensors, Shard(r, 3)).dequantize()
            assert torch.equal(mine, expected_shard(whole, layer, config, r, 3)), layer


def test_shard_config_refuses_what_it_cannot_split():
    config = ModelConfig("llama", VOCAB, 576, 1536, 1, 9, 3, 64, 64)
    assert config.shard(1) is config
    third = config.shard(3)
    assert (third.num_heads, third.num_kv_heads, third.intermediate_size) == (3, 1, 512)
    assert (third.hidden_size, third.head_dim, third.tensor_parallel_size) == (576, 64, 3)
    with pytest.raises(ValueError, match="num_heads 9, num_kv_heads 3 do not divide by .* 2$"):
        config.shard(2)
    # Fewer KV heads than ranks: refused, not replicated over the ranks as vLLM does.
    for heads, kv_heads in [(8, 2), (12, 3)]:
        few = ModelConfig("llama", VOCAB, 576, 1536, 1, heads, kv_heads, 64, 64)
        with pytest.raises(
            ValueError,
            match=f": num_kv_heads {kv_heads} do not divide by world_size 4; fewer KV heads "
            "than ranks, and KV heads are not replicated",
        ):
            few.shard(4)


def test_gguf_tensor_reads_any_columns_of_a_kquant(tmp_path):
    """Columns inside a K-quant's super-block of 256: the covering blocks decoded, the rest
    dropped; the same values as the whole tensor's."""
    reader = gguf.GGUFReader(gguf_file(tmp_path, KQUANT, K_TYPES))
    tensors = gguf_tensors(reader, gguf_config(reader), keep_quantized=False)
    down = tensors["model.layers.0.mlp.down_proj.weight"]
    whole = down.read()
    assert torch.equal(down.read(slice(3, 9), slice(96, 160)), whole[3:9, 96:160])
