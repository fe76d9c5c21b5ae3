"""benchmarks/moe_gguf.py writes mixture-of-experts GGUF files in llama.cpp's names and
metadata: read back with the gguf package at tiny shapes, every tensor has the name, ggml shape
and type llama.cpp's loader asks for, and the expert metadata is there."""

import gguf
import numpy as np
import pytest

from benchmarks.moe_gguf import load_shape, moe_configs, tensor_shapes, write_moe_gguf

Q = gguf.GGMLQuantizationType
TINY = {
    "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 320,
    "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "num_experts_per_tok": 2,
}  # fmt: skip


def _read(tmp_path, config: dict, qtype: Q = Q.Q4_0) -> gguf.GGUFReader:
    return gguf.GGUFReader(write_moe_gguf(tmp_path / "moe.gguf", config, qtype))


def _layer(reader: gguf.GGUFReader, i: int) -> dict[str, tuple[str, list[int]]]:
    """blk.i's tensors: short name -> (type, ggml shape)."""
    prefix = f"blk.{i}."
    return {
        t.name.removeprefix(prefix): (t.tensor_type.name, [int(n) for n in t.shape])
        for t in reader.tensors
        if t.name.startswith(prefix)
    }


def _value(reader: gguf.GGUFReader, key: str):
    return reader.fields[key].contents()


def test_qwen3moe_tensors_and_metadata(tmp_path):
    config = TINY | {
        "model_type": "qwen3_moe", "intermediate_size": 96, "moe_intermediate_size": 32,
        "num_experts": 4,
    }  # fmt: skip
    reader = _read(tmp_path, config)
    assert _value(reader, "general.architecture") == "qwen3moe"
    # ggml shapes list the row width first; head_dim 32 * 4 heads = 128 is wider than hidden 64
    assert _layer(reader, 1) == {
        "attn_norm.weight": ("F32", [64]),
        "attn_q.weight": ("Q4_0", [64, 128]),
        "attn_k.weight": ("Q4_0", [64, 64]),
        "attn_v.weight": ("Q4_0", [64, 64]),
        "attn_output.weight": ("Q4_0", [128, 64]),
        "attn_q_norm.weight": ("F32", [32]),
        "attn_k_norm.weight": ("F32", [32]),
        "ffn_norm.weight": ("F32", [64]),
        "ffn_gate_inp.weight": ("F32", [64, 4]),
        "ffn_gate_exps.weight": ("Q4_0", [64, 32, 4]),
        "ffn_up_exps.weight": ("Q4_0", [64, 32, 4]),
        "ffn_down_exps.weight": ("Q4_0", [32, 64, 4]),
    }
    names = {t.name for t in reader.tensors}
    assert {"token_embd.weight", "output_norm.weight", "output.weight"} < names
    assert len(names) == 3 + 2 * 12
    assert _value(reader, "qwen3moe.block_count") == 2
    assert _value(reader, "qwen3moe.expert_count") == 4
    assert _value(reader, "qwen3moe.expert_used_count") == 2
    assert _value(reader, "qwen3moe.expert_feed_forward_length") == 32
    assert _value(reader, "qwen3moe.feed_forward_length") == 96
    assert _value(reader, "qwen3moe.attention.key_length") == 32
    assert _value(reader, "general.file_type") == gguf.LlamaFileType.MOSTLY_Q4_0


def test_mixtral_is_llama_with_experts(tmp_path):
    config = TINY | {"model_type": "mixtral", "intermediate_size": 96, "num_local_experts": 8}
    del config["head_dim"]  # Mixtral's config has none: hidden / heads
    reader = _read(tmp_path, config, Q.Q8_0)
    assert _value(reader, "general.architecture") == "llama"
    layer = _layer(reader, 0)
    assert set(layer) == {
        "attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
        "attn_output.weight", "ffn_norm.weight", "ffn_gate_inp.weight",
        "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight",
    }  # fmt: skip
    assert layer["attn_k.weight"] == ("Q8_0", [64, 32])
    assert layer["ffn_gate_exps.weight"] == ("Q8_0", [64, 96, 8])
    assert layer["ffn_down_exps.weight"] == ("Q8_0", [96, 64, 8])
    assert _value(reader, "llama.expert_count") == 8
    assert _value(reader, "llama.feed_forward_length") == 96
    assert "llama.expert_feed_forward_length" not in reader.fields


def test_olmoe_norms_whole_projections(tmp_path):
    config = TINY | {
        "model_type": "olmoe", "intermediate_size": 32, "num_experts": 4,
        "num_key_value_heads": 4, "head_dim": 16,
    }  # fmt: skip
    reader = _read(tmp_path, config)
    assert _value(reader, "general.architecture") == "olmoe"
    layer = _layer(reader, 1)
    assert layer["attn_q_norm.weight"] == ("F32", [64])
    assert layer["attn_k_norm.weight"] == ("F32", [64])
    assert layer["ffn_up_exps.weight"] == ("Q4_0", [64, 32, 4])
    assert _value(reader, "olmoe.expert_used_count") == 2


def test_values_and_tokenizer(tmp_path):
    config = TINY | {"model_type": "olmoe", "intermediate_size": 32, "num_experts": 4}
    reader = _read(tmp_path, config)
    tensors = {t.name: t for t in reader.tensors}
    router = np.asarray(tensors["blk.0.ffn_gate_inp.weight"].data)
    assert router.shape == (4, 64) and 0.05 < router.std() < 0.2  # about 1 / sqrt(64)
    assert (np.asarray(tensors["blk.0.attn_norm.weight"].data) == 1).all()
    experts = np.asarray(tensors["blk.0.ffn_gate_exps.weight"].data)
    assert experts.shape == (4, 32, 64 // 32 * 18)  # Q4_0: 18 bytes a block of 32
    assert len(np.unique(experts[:, :, 2:])) > 200  # random codes after each block's scale
    tokens = _value(reader, "tokenizer.ggml.tokens")
    assert len(tokens) == 320 and len(set(tokens)) == 320
    assert _value(reader, "tokenizer.ggml.merges") == ["Ġ t"] and "Ġt" in tokens
    # llama.cpp refuses a pre-tokenizer name it does not know ("gpt2": it says "gpt-2")
    assert _value(reader, "tokenizer.ggml.pre") == "default"
    assert _value(reader, "tokenizer.ggml.eos_token_id") == 319


def test_named_shapes_are_whole_q4_0_blocks():
    # every named MoE config is offered, and its rows fit Q4_0 blocks
    assert {"qwen3-30b-a3b", "mixtral-8x7b", "olmoe-1b-7b"} <= set(moe_configs())
    for name in moe_configs():
        for tensor, shape in tensor_shapes(load_shape(name), 1).items():
            assert len(shape) == 1 or shape[-1] % 32 == 0, (name, tensor)


def test_layers_out_of_range(tmp_path):
    config = TINY | {"model_type": "olmoe", "intermediate_size": 32, "num_experts": 4}
    with pytest.raises(SystemExit, match="--layers must be 1..2"):
        write_moe_gguf(tmp_path / "x.gguf", config, Q.Q4_0, layers=3)
