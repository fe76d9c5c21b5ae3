"""Write a GGUF file with a mixture-of-experts model's shapes and random weights, in llama.cpp's
tensor names and metadata, so that tinyllm and llama.cpp can be measured on the same file without
a download (benchmarks/gguf_load_time.py --write does this for dense shapes).

SHAPE is one of tinyllm's named configs (loaders/configs) of a MoE model type: qwen3-30b-a3b as
`qwen3moe`, mixtral-8x7b as `llama` with experts, olmoe-1b-7b as `olmoe`; or a Hugging Face
config.json of one of those model types. Matrices are random blocks of one type (Q4_0, Q4_1 or
Q8_0) with a plausible scale, the routers F32 (so that tokens spread over the experts), the
norms ones; the tokenizer is gguf_load_time's byte-level one. Tensors are written one at a
time, so an 8B..30B-class file never sits in memory.
`--layers N` keeps the first N layers, for a file that fits where the full one does not:

    python -m benchmarks.moe_gguf olmoe-1b-7b /tmp/olmoe.Q4_0.gguf
    python -m benchmarks.moe_gguf qwen3-30b-a3b /tmp/qwen3moe-4l.Q4_0.gguf --layers 4
"""

import argparse
import json
import math
import shutil
import time
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from benchmarks.gguf_load_time import BLOCK_TYPES, add_byte_tokenizer, random_blocks
from tinyllm.loaders.dummy import named_configs

Q = gguf.GGMLQuantizationType
T = gguf.MODEL_TENSOR

# Hugging Face model_type -> the architecture llama.cpp's converter writes.
ARCHS = {
    "qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE,
    "mixtral": gguf.MODEL_ARCH.LLAMA,
    "olmoe": gguf.MODEL_ARCH.OLMOE,
}
FILE_TYPES = {
    Q.Q4_0: gguf.LlamaFileType.MOSTLY_Q4_0,
    Q.Q4_1: gguf.LlamaFileType.MOSTLY_Q4_1,
    Q.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0,
}


def moe_configs() -> dict[str, Path]:
    """tinyllm's named real configs (loaders/configs) of the model types written here."""
    return {
        name: path
        for name, path in named_configs().items()
        if json.loads(path.read_text())["model_type"] in ARCHS
    }


def load_shape(shape: str) -> dict[str, Any]:
    """A named config's values, or those of the config.json at path `shape`."""
    names = moe_configs()
    path = names.get(shape) or Path(shape).expanduser()
    if not path.is_file():
        raise SystemExit(f"no such shape {shape!r}: give a config.json or one of {list(names)}")
    return json.loads(path.read_text())


def tensor_shapes(config: dict[str, Any], layers: int) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> shape, rows first (numpy's order, ggml's reversed), for `layers`
    layers. The names are gguf's for the architecture: each of its tensors this model has."""
    arch = ARCHS[config["model_type"]]
    h, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or h // heads
    q, kv = heads * head_dim, config["num_key_value_heads"] * head_dim
    experts = config.get("num_experts") or config["num_local_experts"]
    ffn = config.get("moe_intermediate_size") or config["intermediate_size"]
    vocab = config["vocab_size"]
    # OLMoE normalises the whole query and key projections, Qwen3-MoE each head.
    q_norm, k_norm = ((q,), (kv,)) if arch == gguf.MODEL_ARCH.OLMOE else ((head_dim,),) * 2
    shapes = {
        T.TOKEN_EMBD: (vocab, h), T.OUTPUT_NORM: (h,), T.OUTPUT: (vocab, h),
        T.ATTN_NORM: (h,), T.ATTN_Q: (q, h), T.ATTN_K: (kv, h), T.ATTN_V: (kv, h),
        T.ATTN_OUT: (h, q), T.ATTN_Q_NORM: q_norm, T.ATTN_K_NORM: k_norm,
        T.FFN_NORM: (h,), T.FFN_GATE_INP: (experts, h),
        T.FFN_GATE_EXP: (experts, ffn, h), T.FFN_UP_EXP: (experts, ffn, h),
        T.FFN_DOWN_EXP: (experts, h, ffn),
    }  # fmt: skip
    # The dense MLP and rope factors some of these architectures list are not in these models.
    templates = [
        (gguf.TENSOR_NAMES[tensor] + ".weight", shapes[tensor])
        for tensor in gguf.MODEL_TENSORS[arch]
        if tensor in shapes
    ]
    names = {name: shape for name, shape in templates if "{bid}" not in name}
    for i in range(layers):  # layer by layer, as converted files are laid out
        names |= {name.format(bid=i): shape for name, shape in templates if "{bid}" in name}
    return names


def _add_metadata(writer: gguf.GGUFWriter, config: dict[str, Any], layers: int, qtype: Q) -> None:
    """The hyperparameters llama.cpp's convert_hf_to_gguf.py writes for these models."""
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer.add_file_type(FILE_TYPES[qtype])
    writer.add_block_count(layers)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_expert_count(config.get("num_experts") or config["num_local_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    if "moe_intermediate_size" in config:
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    add_byte_tokenizer(writer, config["vocab_size"])


def _stored(name: str, shape: tuple[int, ...], qtype: Q) -> tuple[tuple[int, ...], type, Q | None]:
    """(shape, numpy dtype, block type) of a tensor as written: F32 for norms and routers, the
    bytes of `qtype` blocks for the matrices."""
    if len(shape) == 1 or ".ffn_gate_inp." in name:
        return shape, np.float32, None
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if shape[-1] % block_size:
        raise ValueError(f"{name}: rows of {shape[-1]} are not whole {qtype.name} blocks")
    return (*shape[:-1], shape[-1] // block_size * type_size), np.uint8, qtype


def _random(name: str, shape: tuple[int, ...], qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """The values of a tensor: ones for norms, a router whose logits have about unit spread on
    normalised inputs, random blocks for the matrices."""
    if len(shape) == 1:
        return np.ones(shape, np.float32)
    if ".ffn_gate_inp." in name:
        return rng.standard_normal(shape, np.float32) / np.float32(math.sqrt(shape[-1]))
    rows = random_blocks((math.prod(shape[:-1]), shape[-1]), qtype, rng)
    return rows.reshape(*shape[:-1], -1)


def write_moe_gguf(
    path: Path, config: dict[str, Any], qtype: Q, layers: int | None = None, seed: int = 0
) -> Path:
    """Write `config`'s model (its first `layers` layers) to `path`, one tensor at a time."""
    layers = layers or config["num_hidden_layers"]
    if not 1 <= layers <= config["num_hidden_layers"]:
        raise SystemExit(f"--layers must be 1..{config['num_hidden_layers']}, got {layers}")
    arch = gguf.MODEL_ARCH_NAMES[ARCHS[config["model_type"]]]
    shapes = tensor_shapes(config, layers)
    stored = {name: _stored(name, shape, qtype) for name, shape in shapes.items()}
    total = sum(math.prod(shape) * np.dtype(dtype).itemsize for shape, dtype, _ in stored.values())
    free = shutil.disk_usage(path.parent).free
    if total > free:
        raise SystemExit(f"{path}: needs {total / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free")
    writer = gguf.GGUFWriter(path, arch)
    _add_metadata(writer, config, layers, qtype)
    for name, (shape, dtype, raw_dtype) in stored.items():
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        writer.add_tensor_info(name, shape, np.dtype(dtype), nbytes, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, shape in shapes.items():
        writer.write_tensor_data(_random(name, shape, qtype, rng))
    writer.close()
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("shape", help=f"one of {', '.join(moe_configs())}, or a config.json")
    parser.add_argument("out", type=Path, help="the GGUF file to write")
    parser.add_argument("--type", choices=BLOCK_TYPES, default="Q4_0")
    parser.add_argument("--layers", type=int, help="keep only the first N layers")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    start = time.perf_counter()
    config = load_shape(args.shape)
    path = write_moe_gguf(args.out, config, BLOCK_TYPES[args.type], args.layers, args.seed)
    size = path.stat().st_size / 2**30
    print(f"wrote {path}: {size:.2f} GiB in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
