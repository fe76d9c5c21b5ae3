"""`load_format="dummy"` (vLLM's name): a model built from a config alone, with random weights in
the format it will run in, so that real model shapes can be benchmarked without downloads.

The config is a Hugging Face config.json (a file, or a directory holding one) or one of the
named real configs shipped in loaders/configs/. Quantized weights are made as blocks directly
(model/quant.py's GroupQuantized: random codes, plausible scales), never as a dense fp32 matrix
first, so an 8B-class int4 model takes about its packed size in memory
(docs/MEASUREMENTS.md, "Real model shapes", measures the build). Every
layer shares one random code tensor per projection shape (a layer's own scales differ): the
kernel reads each layer's packed copy all the same, and drawing codes for every layer would
cost time and memory and measure nothing more.
"""

import math
from importlib import resources
from pathlib import Path

import tokenizers
import torch
from tokenizers.models import WordLevel
from torch import Tensor, nn

from tinyllm.host.memory import available_bytes
from tinyllm.loaders.hf import hf_config
from tinyllm.loaders.source import Checkpoint
from tinyllm.loaders.stored import InMemory
from tinyllm.model.config import ModelConfig, ModelLoadError
from tinyllm.model.families import build_model
from tinyllm.model.quant import GROUP, GroupQuantized
from tinyllm.text.tokenizer import Tokenizer

SEED = 0
# Bytes each linear weight takes while a quantized dummy model is built and packed: its fp32
# scale and offset (8 / 32) and the packed copy (codes, fp16 scale and offset); the codes are
# shared across layers, so not counted.
_QUANT_BYTES = {bits: bits / 8 + 8 / GROUP + 4 / GROUP for bits in (4, 8)}
# ModelConfig's sizes, by their names in config.json.
_SIZES = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "max_position_embeddings": "max_position_embeddings",
}
_NO_TOKENIZER = (
    "dummy weights (load_format='dummy') come without a tokenizer: give prompts as token ids "
    "(tinyllm bench does), or load a real model for text"
)


def named_configs() -> dict[str, Path]:
    """The real models' configs shipped with tinyllm, by name (e.g. "llama-3.2-1b")."""
    folder = resources.files("tinyllm.loaders") / "configs"
    return {
        p.name.removesuffix(".json"): Path(str(p))
        for p in folder.iterdir()
        if p.name.endswith(".json")
    }


def dummy_config(model: str | None) -> tuple[str, Path, ModelConfig]:
    """(name, folder of its config.json, config) of `model`: a named config, a config.json, or
    a directory holding one."""
    names = named_configs()
    choices = f"a config.json path or one of {', '.join(sorted(names))}"
    if model is None:
        raise ModelLoadError(f"load_format='dummy' needs a model config: {choices}")
    path = names.get(model) or Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"load_format='dummy': no such config {model!r}; give {choices}")
    config = hf_config(path)
    for field, key in _SIZES.items():
        value = getattr(config, field)
        if not isinstance(value, int) or value < 1:
            raise ModelLoadError(f"{path}: {key} must be a positive integer, got {value!r}")
    folder = path.parent if path.is_file() else path
    return (model if model in names else folder.resolve().name), folder, config


def load_dummy(model: str | None, quantization: str, dtype: torch.dtype) -> Checkpoint:
    """The model `model` configures, with random weights in `quantization`'s format (the whole
    model's: a tensor-parallel rank keeps its shards of them)."""
    name, folder, config = dummy_config(model)
    tensors = {k: InMemory(w) for k, w in dummy_weights(config, quantization, dtype).items()}
    return Checkpoint(name, folder, config, tensors, IdsOnlyTokenizer(config.vocab_size))


def _linear_shapes(c: ModelConfig, layer: int) -> dict[str, tuple[int, int]]:
    """(out, in) of decoder layer `layer`'s quantizable linear weights, fused as the model runs
    them: a MoE layer's experts' (model/moe.py) in place of the MLP's."""
    q, kv, h = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.hidden_size
    shapes = {"self_attn.qkv_proj": (q + 2 * kv, h), "self_attn.o_proj": (h, q)}
    if not c.is_moe_layer(layer):
        return shapes | {
            "mlp.gate_up_proj": (2 * c.intermediate_size, h),
            "mlp.down_proj": (h, c.intermediate_size),
        }
    ffn = c.moe_intermediate_size
    for e in range(c.num_experts):
        shapes[f"mlp.experts.{e}.gate_up_proj"] = (2 * ffn, h)
        shapes[f"mlp.experts.{e}.down_proj"] = (h, ffn)
    return shapes


def _vector_shapes(c: ModelConfig, layer: int) -> dict[str, int]:
    """Sizes of decoder layer `layer`'s biases (q/k/v's, gpt-oss's o_proj's, router's and
    experts') and attention sinks, each zeros in dummy weights."""
    q, kv, h = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.hidden_size
    shapes = {"self_attn.qkv_proj.bias": (q + 2 * kv) * c.attention_bias}
    shapes |= {"self_attn.o_proj.bias": h * c.o_proj_bias}
    shapes |= {"self_attn.sinks": c.num_heads * c.attention_sinks}
    if c.moe_bias and c.is_moe_layer(layer):
        shapes["mlp.gate.bias"] = c.num_experts
        for e in range(c.num_experts):
            shapes[f"mlp.experts.{e}.gate_up_proj.bias"] = 2 * c.moe_intermediate_size
            shapes[f"mlp.experts.{e}.down_proj.bias"] = h
    return {name: n for name, n in shapes.items() if n}


def _meta_model(c: ModelConfig) -> nn.Module:
    """The model's modules with shapes and no memory (the meta device)."""
    with torch.device("meta"):
        return build_model(c)


def parameter_count(c: ModelConfig) -> int:
    """The model's parameters as its checkpoint counts them (a tied head once), from shapes."""
    if not c.is_causal:  # an encoder: its modules' shapes
        return sum(p.numel() for p in _meta_model(c).parameters())
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    total = 0
    for i in range(c.num_layers):
        total += (
            sum(n * k for n, k in _linear_shapes(c, i).values())
            + (2 + 2 * c.post_norms) * c.hidden_size
        )
        total += c.num_experts * c.hidden_size * c.is_moe_layer(i)  # the router
        total += sum(_vector_shapes(c, i).values())
    norms = (q + kv) if c.qk_norm_all_heads else 2 * c.head_dim
    total += c.num_layers * norms * c.qk_norm
    embed = c.vocab_size * c.hidden_size
    return total + c.hidden_size + embed * (1 if c.tie_word_embeddings else 2)


def _check_memory(c: ModelConfig, quantization: str, dtype: torch.dtype) -> None:
    params = parameter_count(c)
    if quantization == "none":
        need, what = params * dtype.itemsize, f"dense {str(dtype).removeprefix('torch.')}"
    else:  # an untied embedding table stays dense
        dense = 0 if c.tie_word_embeddings else c.vocab_size * c.hidden_size
        bits = 8 if quantization == "int8" else 4
        need = (params - dense) * _QUANT_BYTES[bits] + dense * dtype.itemsize
        what = quantization
    free = available_bytes(torch.device("cpu"))
    if free is not None and need > free:
        smaller = (
            "a smaller config"
            if quantization == "int4"
            else "quantization int4 or a smaller config"
        )
        raise ModelLoadError(
            f"dummy weights of {params / 1e9:.2f}B parameters in {what} need about "
            f"{need / 2**30:.1f} GiB, more than the {free / 2**30:.1f} GiB available; use {smaller}"
        )


class _Random:
    """Deterministic random weights (one seeded generator, drawn in a fixed order)."""

    def __init__(self, dtype: torch.dtype, seed: int) -> None:
        self.dtype, self.gen = dtype, torch.Generator().manual_seed(seed)
        self.codes: dict[tuple[int, int, int], Tensor] = {}

    def dense(self, n: int, k: int) -> Tensor:
        """Weights of std 1/sqrt(k), so each layer keeps its activations' scale."""
        w = torch.randn(n, k, generator=self.gen, dtype=self.dtype)
        return w.mul_(k**-0.5)

    def blocks(self, n: int, k: int, bits: int) -> GroupQuantized:
        """Blocks whose weights have std about 1/sqrt(k): codes uniform over the grid, each
        group's scale within a factor of 2 of the typical one, offset centring the grid."""
        lo, top = (0, 15) if bits == 4 else (1, 255)  # 8-bit codes stay off 0 (see quant.pack)
        key = (n, k, bits)
        if key not in self.codes:
            # Random bytes drawn 8 at a time (cheaper than a uint8 randint), then on the grid.
            words = torch.empty(n * k // 8, dtype=torch.int64)
            codes = words.random_(-(2**63), None, generator=self.gen).view(torch.uint8)
            codes = codes.bitwise_and_(15) if bits == 4 else codes.clamp_min_(1)
            self.codes[key] = codes.view(n, k)
        typical = k**-0.5 / ((top - lo + 1) / math.sqrt(12))  # a uniform code's std
        scale = torch.rand(n, k // GROUP, generator=self.gen).add_(0.5).mul_(typical)
        scale = scale.half().float()  # as the packed format stores it
        return GroupQuantized(self.codes[key], scale, -(lo + top) / 2 * scale, bits)


def dummy_weights(
    c: ModelConfig, quantization: str, dtype: torch.dtype, seed: int = SEED
) -> dict[str, Tensor | GroupQuantized]:
    """A random state dict in the model's own names (q/k/v and gate/up fused): linear weights
    as blocks for "int4"/"int8" (the LM head in 8 bits, as quantize_linears runs it), dense in
    `dtype` for "none"."""
    widths = {
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads * head_dim": c.num_heads * c.head_dim,
        **({"moe_intermediate_size": c.moe_intermediate_size} if c.num_experts else {}),
    }
    bad = [f"{name}={width}" for name, width in widths.items() if width % GROUP]
    if quantization != "none" and bad:
        raise ModelLoadError(
            f"quantized dummy weights need dimensions in whole groups of {GROUP}: {', '.join(bad)}"
        )
    _check_memory(c, quantization, dtype)
    rand = _Random(dtype, seed)
    layer_bits = {"int4": 4, "int8": 8}.get(quantization)
    if not c.is_causal:
        return _encoder_weights(c, rand, layer_bits)

    def linear(n: int, k: int, bits: int | None) -> Tensor | GroupQuantized:
        return rand.dense(n, k) if bits is None else rand.blocks(n, k, bits)

    def ones(n: int) -> Tensor:  # a norm's weight, its own tensor (the model assigns them)
        return torch.ones(n, dtype=dtype)

    head_bits = None if layer_bits is None else 8
    weights: dict[str, Tensor | GroupQuantized] = {"model.norm.weight": ones(c.hidden_size)}
    if c.tie_word_embeddings:
        weights["model.embed_tokens.weight"] = linear(c.vocab_size, c.hidden_size, head_bits)
    else:
        weights["model.embed_tokens.weight"] = rand.dense(c.vocab_size, c.hidden_size)
        weights["lm_head.weight"] = linear(c.vocab_size, c.hidden_size, head_bits)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        for name, (n, k) in _linear_shapes(c, i).items():
            weights[f"{p}{name}.weight"] = linear(n, k, layer_bits)
        if c.is_moe_layer(i):  # the router, never quantized
            weights[f"{p}mlp.gate.weight"] = rand.dense(c.num_experts, c.hidden_size)
        gemma = ("pre_feedforward_layernorm", "post_feedforward_layernorm") * c.post_norms
        for norm in ("input_layernorm", "post_attention_layernorm", *gemma):
            weights[f"{p}{norm}.weight"] = ones(c.hidden_size)
        for name, n in _vector_shapes(c, i).items():
            weights[f"{p}{name}"] = torch.zeros(n, dtype=dtype)
        if c.qk_norm:
            q, kv = (c.num_heads, c.num_kv_heads) if c.qk_norm_all_heads else (1, 1)
            weights[f"{p}self_attn.q_norm.weight"] = ones(q * c.head_dim)
            weights[f"{p}self_attn.k_norm.weight"] = ones(kv * c.head_dim)
    return weights


def _encoder_weights(
    c: ModelConfig, rand: _Random, bits: int | None
) -> dict[str, Tensor | GroupQuantized]:
    """An encoder's random state dict (model/encoder.py), by its parameters' names and shapes:
    linear weights as blocks of `bits` (dense without), LayerNorms 1, biases 0, embeddings
    dense."""
    model = _meta_model(c)
    linears = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    weights: dict[str, Tensor | GroupQuantized] = {}
    for name, p in model.named_parameters():
        if name in linears:
            n, k = p.shape
            weights[name] = rand.dense(n, k) if bits is None else rand.blocks(n, k, bits)
        elif p.dim() == 2:  # an embedding table
            weights[name] = rand.dense(*p.shape)
        else:
            fill = 0.0 if name.endswith(".bias") else 1.0
            weights[name] = torch.full(p.shape, fill, dtype=rand.dtype)
    return weights


class IdsOnlyTokenizer(Tokenizer):
    """Dummy weights' tokenizer: no text in, ids out as "<id>" (for the engine's detokenizer)."""

    def __init__(self, vocab_size: int) -> None:
        vocab = {f"<{i}>": i for i in range(vocab_size)}
        super().__init__(
            tokenizers.Tokenizer(WordLevel(vocab, unk_token="<0>")),
            bos_token_id=None,
            eos_token_ids=[],
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise ValueError(_NO_TOKENIZER)

    def encode_chat(self, messages, add_generation_prompt=True, tools=None, **_):
        raise ValueError(_NO_TOKENIZER)
