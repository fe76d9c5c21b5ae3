"""Load a llama.cpp GGUF file: its metadata as a ModelConfig, its tensors by Hugging Face name,
each read as a dequantized torch tensor or as the quantized linear layers' groups."""

import math
import os
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf.gguf_reader import ReaderTensor

from tinyllm.loaders.gguf_blocks import KERNEL_BITS, groups
from tinyllm.loaders.stored import ALL, StoredTensor
from tinyllm.model.config import (
    ModelConfig,
    ModelLoadError,
    UnsupportedModelError,
    serve_within_window,
    unsupported_architecture,
)
from tinyllm.model.quant import GroupQuantized

# Mistral's and Mixtral's GGUFs say "llama" (Mixtral's with experts).
GGUF_ARCHITECTURES = (
    "llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "qwen3moe", "olmoe", "gpt-oss",
)  # fmt: skip
# llama.cpp's encoder architectures, whose families tinyllm runs from safetensors only.
ENCODER_GGUF_ARCHITECTURES = ("bert", "nomic-bert")
# Gemma's sliding layers, as llama.cpp has them: all but every n-th (Gemma 2: every other,
# Gemma 3: 5 of 6), unless the file gives {arch}.attention.sliding_window_pattern.
GEMMA_SWA_PATTERN = {"gemma2": 2, "gemma3": 6}
# llama.cpp's 27B sizes of each (by block count), whose attention scale is hidden / heads, not
# head_dim: query_pre_attn_scalar, which the file does not store.
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# The model's architecture of a GGUF one with experts, and whether the family renormalises its
# top-k router weights (llama.cpp's choice for each; a file's expert_weights_norm overrides it).
MOE_ARCHITECTURES = {
    "llama": ("mixtral", True),
    "qwen3moe": ("qwen3_moe", True),
    "olmoe": ("olmoe", False),
    "gpt-oss": ("gpt_oss", False),  # the softmax of its top-k logits sums to 1 already
}
# gpt-oss's experts' SwiGLU clamp, which llama.cpp fixes where a file's swiglu_clamp_exp (one
# per layer) does not give it.
GPT_OSS_SWIGLU_LIMIT = 7.0

Q = gguf.GGMLQuantizationType
SUPPORTED_TENSOR_TYPES = (
    Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1,
    Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.MXFP4,
)  # fmt: skip

# Files at least this big show a progress bar over their tensors on stderr (as vLLM and
# llama.cpp show loading progress): a 1B-class int4 file takes long enough to read to need one.
PROGRESS_BYTES = 512 * 2**20

# Llama 3 GGUFs carry no rope-scaling metadata, only this tensor of per-frequency divisors.
ROPE_FREQS = "rope_freqs.weight"
# Phi-3's LongRoPE factors (llama.cpp's converter writes them for Phi-3.5 and Phi-4-mini).
LONGROPE_FACTORS = {
    "short_factor": "rope_factors_short.weight",
    "long_factor": "rope_factors_long.weight",
}
CONFIG_TENSORS = (ROPE_FREQS, *LONGROPE_FACTORS.values())


class _CheckedReader(gguf.GGUFReader):
    """A GGUFReader that names the tensor a truncated file cuts off, instead of failing with
    numpy's "cannot reshape array of size ..." (or, for a newer tensor type, an enum error),
    and that reads the file through a plain ndarray view of its map.

    It hooks the private _build_tensors and _get_str, whose signatures are the same from gguf
    0.10 to 0.19, and the `data` attribute that __init__ sets to the np.memmap: the reader
    slices the map once or twice per metadata value, and np.memmap's Python-level slicing
    hooks make a large vocabulary slow to read. The view's base keeps the map open.
    """

    filename: str

    @property
    def data(self) -> np.ndarray:
        return self._mapped

    @data.setter
    def data(self, mapped: np.memmap) -> None:
        self.filename = mapped.filename
        self._mapped = mapped.view(np.ndarray)

    def _get_str(self, offset: int) -> tuple[np.ndarray, np.ndarray]:
        """The private _get_str without its per-call dtype work, for native byte order: it runs
        once per vocabulary token and merge."""
        if self.byte_order != "I":
            return super()._get_str(offset)
        length = self.data[offset : offset + 8].view(np.uint64)
        return length, self.data[offset + 8 : offset + 8 + int(length[0])]

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        file_size = len(self.data)
        for field in fields:
            _, name_data, _, dims, raw_type, offset = field.parts
            name = bytes(name_data).decode("utf-8", errors="replace")
            try:
                qtype = Q(int(raw_type[0]))
            except ValueError:
                raise UnsupportedModelError(
                    f"tensor {name!r} has tensor type {int(raw_type[0])}, unknown to this gguf"
                ) from None
            block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
            n_bytes = math.prod(int(d) for d in dims) * type_size // block_size
            end = start_offs + int(offset[0]) + n_bytes
            if end > file_size:
                raise ModelLoadError(
                    f"truncated: tensor {name!r} needs {end - file_size} bytes past end of file "
                    f"({file_size} bytes)"
                )
        super()._build_tensors(start_offs, fields)


def open_gguf(path: str | os.PathLike) -> gguf.GGUFReader:
    """Memory-map a GGUF file, checking that it is one and that every tensor lies inside it."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(f"{path}: not a GGUF file (bad magic {magic!r}, expected b'GGUF')")
    try:
        return _CheckedReader(path)
    except (ModelLoadError, UnsupportedModelError) as e:
        raise type(e)(f"{path}: {e}") from None
    # The reader parses with raw numpy views, so a damaged header surfaces as any of these.
    except (ValueError, IndexError, KeyError, OverflowError) as e:
        raise ModelLoadError(f"{path}: corrupt GGUF header ({type(e).__name__}: {e})") from e


def _where(reader: gguf.GGUFReader) -> str:
    """The file's name, for errors (open_gguf's reader keeps it beside its plain view)."""
    return getattr(reader, "filename", None) or reader.data.filename


def _value(reader: gguf.GGUFReader, key: str, default=None):
    """A scalar or string metadata value (ReaderField.contents() is missing from older gguf)."""
    field = reader.get_field(key)
    if field is None:
        return default
    part = field.parts[field.data[0]]
    if field.types[0] == gguf.GGUFValueType.STRING:
        return bytes(part).decode("utf-8")
    if field.types[0] == gguf.GGUFValueType.FLOAT32:
        return float(str(part[0]))  # shortest decimal, so a stored 1e-5 reads back as 1e-5
    return part[0].item()


def _required(reader: gguf.GGUFReader, key: str):
    value = _value(reader, key)
    if value is None:
        raise ModelLoadError(f"{_where(reader)}: GGUF metadata lacks {key!r}")
    return value


def _llama3_rope_scaling(
    freq_factors: np.ndarray, head_dim: int, theta: float, original_context: int
) -> dict | None:
    """Recover Hugging Face's llama3 rope_scaling dict from llama.cpp's rope_freqs tensor.

    With x = original_context / wavelength, HF divides a frequency by `factor` where x < low,
    by 1 where x > high, and in between by 1 / ((1 - s) / factor + s), s = (x - low) / (high - low).
    s is linear in x, so a line through the in-between frequencies gives low and high.
    """
    factor = float(freq_factors.max())
    if factor <= 1:
        return None
    x = original_context * theta ** (-np.arange(0, head_dim, 2) / head_dim) / (2 * np.pi)
    # The stored factors are float32: leave a margin so rounding noise is not taken for blending.
    between = (freq_factors > 1 + 1e-4) & (freq_factors < factor * (1 - 1e-4))
    if between.sum() < 2:
        raise UnsupportedModelError(f"{ROPE_FREQS} has too few blended frequencies to fit")
    s = (1 / freq_factors[between] - 1 / factor) / (1 - 1 / factor)
    slope, intercept = np.polyfit(x[between], s, 1)
    if np.abs(slope * x[between] + intercept - s).max() > 1e-3:
        raise UnsupportedModelError(f"{ROPE_FREQS} does not follow Llama 3 rope scaling")
    low = -intercept / slope
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": float(low),
        "high_freq_factor": float(low + 1 / slope),
        "original_max_position_embeddings": original_context,
    }


def _tensor_values(reader: gguf.GGUFReader, name: str) -> np.ndarray | None:
    """A small tensor that configures the model (CONFIG_TENSORS), as float64; None if absent."""
    tensor = next((t for t in reader.tensors if t.name == name), None)
    if tensor is None:
        return None
    return gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float64)


def _longrope_scaling(reader: gguf.GGUFReader, arch: str, context: int) -> dict | None:
    """Phi-3's LongRoPE from its factor tensors, as llama.cpp's converter stores them."""
    factors = {key: _tensor_values(reader, name) for key, name in LONGROPE_FACTORS.items()}
    if all(f is None for f in factors.values()):
        return None
    if any(f is None for f in factors.values()):
        both = " and ".join(LONGROPE_FACTORS.values())
        raise ModelLoadError(f"{_where(reader)}: LongRoPE needs both {both}")
    original = _required(reader, f"{arch}.rope.scaling.original_context_length")
    factor = context / original
    # The converter writes transformers' default; a file without it gets the same.
    default = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
    return {
        "rope_type": "longrope",
        **{key: f.tolist() for key, f in factors.items()},
        "original_max_position_embeddings": original,
        "attention_factor": _value(reader, f"{arch}.rope.scaling.attn_factor", default),
    }


def _rope_scaling(reader: gguf.GGUFReader, arch: str, head_dim: int, theta: float) -> dict | None:
    original = _value(reader, f"{arch}.rope.scaling.original_context_length")
    kind = _value(reader, f"{arch}.rope.scaling.type")
    if kind is not None and kind != "none":
        scaling = {"rope_type": kind, "factor": _required(reader, f"{arch}.rope.scaling.factor")}
        if original is not None:
            scaling["original_max_position_embeddings"] = original
        if kind == "yarn":  # llama.cpp's defaults; gpt-oss's ramp is not truncated
            for beta, default in (("beta_fast", 32.0), ("beta_slow", 1.0)):
                scaling[beta] = _value(reader, f"{arch}.rope.scaling.yarn_{beta}", default)
            scaling["truncate"] = arch != "gpt-oss"
        return scaling
    if arch == "phi3":
        return _longrope_scaling(reader, arch, _required(reader, f"{arch}.context_length"))
    factors = _tensor_values(reader, ROPE_FREQS)
    if factors is None:
        return None
    # llama.cpp's converter assumes 8192 (Llama 3's) when the HF config does not say.
    return _llama3_rope_scaling(factors, head_dim, theta, original or 8192)


def gguf_config(reader: gguf.GGUFReader) -> ModelConfig:
    """Build a ModelConfig from GGUF metadata and the presence of optional tensors."""
    arch = _required(reader, "general.architecture")
    if arch in ENCODER_GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{_where(reader)}: GGUF architecture {arch!r} (an encoder) is not supported yet; "
            "load the model's Hugging Face directory (safetensors)"
        )
    if arch not in GGUF_ARCHITECTURES:
        error = unsupported_architecture(f"GGUF architecture {arch!r}", arch)
        raise UnsupportedModelError(f"{_where(reader)}: {error}")
    names = {t.name for t in reader.tensors}
    experts = _experts(reader, arch, names)
    hidden = _required(reader, f"{arch}.embedding_length")
    heads = _required(reader, f"{arch}.attention.head_count")
    head_dim = _value(reader, f"{arch}.attention.key_length", hidden // heads)
    rotary_dims = _value(reader, f"{arch}.rope.dimension_count", head_dim)
    if rotary_dims != head_dim and arch != "phi3":  # Phi-4-mini rotates 96 of 128
        raise UnsupportedModelError(
            f"{_where(reader)}: rotary embedding on {rotary_dims} of {head_dim} head dims"
        )
    vocab_size = _value(reader, f"{arch}.vocab_size")
    if vocab_size is None and (tokens := reader.get_field("tokenizer.ggml.tokens")) is not None:
        vocab_size = len(tokens.data)
    if vocab_size is None:
        embedding = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
        if embedding is None:
            raise ModelLoadError(f"{_where(reader)}: no vocab size and no token_embd.weight")
        vocab_size = int(embedding.shape[-1])  # ne order: rows come last
    rope_theta = float(_value(reader, f"{arch}.rope.freq_base", 10000.0))
    config = ModelConfig(
        architecture=MOE_ARCHITECTURES[arch][0] if experts else arch,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=_required(reader, f"{arch}.feed_forward_length"),
        num_layers=_required(reader, f"{arch}.block_count"),
        num_heads=heads,
        num_kv_heads=_value(reader, f"{arch}.attention.head_count_kv", heads),
        head_dim=head_dim,
        max_position_embeddings=_required(reader, f"{arch}.context_length"),
        rms_norm_eps=_required(reader, f"{arch}.attention.layer_norm_rms_epsilon"),
        rope_theta=rope_theta,
        rope_scaling=_rope_scaling(reader, arch, head_dim, rope_theta),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        rotary_dim=rotary_dims if rotary_dims != head_dim else None,
        qk_norm_all_heads=arch == "olmoe",
        **experts,
    )
    # 0: no window (llama.cpp's converter writes it for Phi-3 models without one). Phi-3's is
    # served by cutting the context to it; a llama file's (Mistral's) slides on every layer.
    # Qwen's is not read: which of its layers slide (max_window_layers) has no GGUF key.
    window = _value(reader, f"{arch}.attention.sliding_window", 0)
    if arch == "phi3":
        serve_within_window(config, window)
    elif arch == "llama" and 0 < window < config.max_position_embeddings:
        config.sliding_window = window
    if arch in GEMMA_SWA_PATTERN:
        _gemma_fields(reader, arch, config, window)
    if arch == "gpt-oss":  # a window on every other layer from the first, as llama.cpp's
        config.sliding_window = window or None
        config.sliding_window_layers = tuple(range(0, config.num_layers, 2))
        config.o_proj_bias = "blk.0.attn_output.bias" in names
        config.attention_sinks = "blk.0.attn_sinks.weight" in names
        config.__post_init__()  # checks the window
    return config


def _gemma_fields(reader: gguf.GGUFReader, arch: str, config: ModelConfig, window: int) -> None:
    """Gemma's own fields, as llama.cpp's converter stores (or llama.cpp assumes) them. Its norms
    are stored as 1 + w already: the model's multipliers."""
    n, key = config.num_layers, f"{arch}.attention.sliding_window_pattern"
    field = reader.get_field(key)
    if field is not None and len(field.data) > 1:  # one flag per layer: whether it slides
        slides = [bool(field.parts[i][0]) for i in field.data]
    else:  # every pattern-th layer global, the rest sliding
        pattern = _value(reader, key, GEMMA_SWA_PATTERN[arch])
        slides = [bool((i + 1) % pattern) for i in range(n)]
    if len(slides) != n or window <= 0:
        raise ModelLoadError(
            f"{_where(reader)}: {arch} needs attention.sliding_window and one sliding flag per "
            f"layer ({n})"
        )
    config.sliding_window = window
    config.sliding_window_layers = tuple(i for i in range(n) if slides[i])
    config.hidden_act = "gelu_pytorch_tanh"
    config.embedding_scale = config.hidden_size**0.5
    config.post_norms = True
    config.attn_logit_softcapping = _value(reader, f"{arch}.attn_logit_softcapping")
    config.final_logit_softcapping = _value(reader, f"{arch}.final_logit_softcapping")
    big = n == GEMMA_27B_LAYERS[arch]
    config.query_pre_attn_scalar = config.hidden_size / config.num_heads if big else config.head_dim
    if arch == "gemma3":
        config.rope_local_theta = float(_value(reader, f"{arch}.rope.freq_base_swa", 10000.0))


def _experts(reader: gguf.GGUFReader, arch: str, names: set[str]) -> dict:
    """ModelConfig's mixture-of-experts fields from the file's expert keys; {} without experts.
    A layer whose MLP is dense (a Qwen3-MoE's mlp_only_layers) has ffn_down, not ffn_down_exps."""
    count = _value(reader, f"{arch}.expert_count", 0)
    if not count:
        return {}
    if arch not in MOE_ARCHITECTURES:
        raise UnsupportedModelError(f"{_where(reader)}: {arch} with experts is not supported")
    ffn = _value(reader, f"{arch}.expert_feed_forward_length")
    layers = range(_required(reader, f"{arch}.block_count"))
    return {
        "num_experts": count,
        "num_experts_per_tok": _required(reader, f"{arch}.expert_used_count"),
        "moe_intermediate_size": ffn or _required(reader, f"{arch}.feed_forward_length"),
        "norm_topk_prob": bool(
            _value(reader, f"{arch}.expert_weights_norm", MOE_ARCHITECTURES[arch][1])
        ),
        "dense_mlp_layers": tuple(i for i in layers if f"blk.{i}.ffn_down.weight" in names),
        **(_gpt_oss_experts(reader, arch) if arch == "gpt-oss" else {}),
    }


def _gpt_oss_experts(reader: gguf.GGUFReader, arch: str) -> dict:
    """gpt-oss's expert fields: biases, the softmax of the top-k logits, the SwiGLU clamp."""
    field = reader.get_field(f"{arch}.swiglu_clamp_exp")
    limits = {float(field.parts[i][0]) for i in field.data} if field else {GPT_OSS_SWIGLU_LIMIT}
    if len(limits) != 1:
        raise UnsupportedModelError(f"{_where(reader)}: swiglu_clamp_exp differs by layer")
    return dict(moe_bias=True, softmax_after_topk=True, swiglu_limit=limits.pop())


def _tensor_names(config: ModelConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """GGUF tensor name -> (Hugging Face name, HF shape)."""
    h, ffn, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    names = {
        "token_embd.weight": ("model.embed_tokens.weight", (vocab, h)),
        "output_norm.weight": ("model.norm.weight", (h,)),
    }
    if not config.tie_word_embeddings:
        names["output.weight"] = ("lm_head.weight", (vocab, h))
    layer = {
        "attn_norm.weight": ("input_layernorm.weight", (h,)),
        "attn_output.weight": ("self_attn.o_proj.weight", (h, q)),
        "ffn_norm.weight": ("post_attention_layernorm.weight", (h,)),
        "ffn_down.weight": ("mlp.down_proj.weight", (h, ffn)),
    }
    if config.post_norms:  # Gemma's sandwich: its ffn_norm is the norm before the MLP
        layer["post_attention_norm.weight"] = ("post_attention_layernorm.weight", (h,))
        layer["ffn_norm.weight"] = ("pre_feedforward_layernorm.weight", (h,))
        layer["post_ffw_norm.weight"] = ("post_feedforward_layernorm.weight", (h,))
    if config.architecture == "phi3":  # stacked as in the HF checkpoint: q|k|v and gate|up
        layer["attn_qkv.weight"] = ("self_attn.qkv_proj.weight", (q + 2 * kv, h))
        layer["ffn_up.weight"] = ("mlp.gate_up_proj.weight", (2 * ffn, h))
    else:
        layer["attn_q.weight"] = ("self_attn.q_proj.weight", (q, h))
        layer["attn_k.weight"] = ("self_attn.k_proj.weight", (kv, h))
        layer["attn_v.weight"] = ("self_attn.v_proj.weight", (kv, h))
        layer["ffn_gate.weight"] = ("mlp.gate_proj.weight", (ffn, h))
        layer["ffn_up.weight"] = ("mlp.up_proj.weight", (ffn, h))
    if config.attention_bias:
        layer["attn_q.bias"] = ("self_attn.q_proj.bias", (q,))
        layer["attn_k.bias"] = ("self_attn.k_proj.bias", (kv,))
        layer["attn_v.bias"] = ("self_attn.v_proj.bias", (kv,))
    if config.qk_norm:
        layer["attn_q_norm.weight"] = ("self_attn.q_norm.weight", (config.head_dim,))
        layer["attn_k_norm.weight"] = ("self_attn.k_norm.weight", (config.head_dim,))
    if config.o_proj_bias:  # gpt-oss's
        layer["attn_output.bias"] = ("self_attn.o_proj.bias", (h,))
    if config.attention_sinks:
        layer["attn_sinks.weight"] = ("self_attn.sinks", (config.num_heads,))
    if config.architecture == "gpt_oss":  # its post_attention_layernorm, not ffn_norm
        layer["post_attention_norm.weight"] = layer.pop("ffn_norm.weight")
    if config.qk_norm_all_heads:  # OLMoE's span all heads
        layer["attn_q_norm.weight"] = ("self_attn.q_norm.weight", (q,))
        layer["attn_k_norm.weight"] = ("self_attn.k_norm.weight", (kv,))
    # A MoE layer's router and experts, each expert's weights stacked in one 3-D tensor; the
    # model's name of expert E is the name with "{}" formatted by E.
    e, ffn_e = config.num_experts, config.moe_intermediate_size
    moe = {
        **{k: v for k, v in layer.items() if not k.startswith("ffn_") or k == "ffn_norm.weight"},
        "ffn_gate_inp.weight": ("mlp.gate.weight", (e, h)),
        "ffn_gate_exps.weight": ("mlp.experts.{}.gate_proj.weight", (e, ffn_e, h)),
        "ffn_up_exps.weight": ("mlp.experts.{}.up_proj.weight", (e, ffn_e, h)),
        "ffn_down_exps.weight": ("mlp.experts.{}.down_proj.weight", (e, h, ffn_e)),
    }
    if config.moe_bias:  # gpt-oss's router's and experts' biases, the experts' stacked
        moe["ffn_gate_inp.bias"] = ("mlp.gate.bias", (e,))
        moe["ffn_gate_exps.bias"] = ("mlp.experts.{}.gate_proj.bias", (e, ffn_e))
        moe["ffn_up_exps.bias"] = ("mlp.experts.{}.up_proj.bias", (e, ffn_e))
        moe["ffn_down_exps.bias"] = ("mlp.experts.{}.down_proj.bias", (e, h))
    if config.architecture == "mixtral":  # files converted before the stacked tensors (2023)
        for e in range(config.num_experts):
            moe[f"ffn_gate.{e}.weight"] = (f"mlp.experts.{e}.gate_proj.weight", (ffn_e, h))
            moe[f"ffn_up.{e}.weight"] = (f"mlp.experts.{e}.up_proj.weight", (ffn_e, h))
            moe[f"ffn_down.{e}.weight"] = (f"mlp.experts.{e}.down_proj.weight", (h, ffn_e))
    for i in range(config.num_layers):
        for gguf_name, (hf_name, shape) in (moe if config.is_moe_layer(i) else layer).items():
            names[f"blk.{i}.{gguf_name}"] = (f"model.layers.{i}.{hf_name}", shape)
    return names


def _unpermute_rotary(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Invert llama.cpp's convert-time row permutation of q/k for the llama architecture.

    HF rotates the first half of each head against the second half; llama.cpp's llama kernels
    rotate adjacent pairs, so its converter interleaves each head's rows: stored row 2i + j is
    HF row j * d/2 + i. Indexing the rows as (i, j) and transposing to (j, i) undoes that. It
    moves rows within a head only, so any whole heads (a rank's shard) unpermute alone.
    """
    pairs = head_dim // 2
    return w.reshape(-1, pairs, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _rotary_rows(w: torch.Tensor, name: str, config: ModelConfig) -> torch.Tensor:
    """`w` (rows first: whole heads) with llama's q/k row order restored; any other tensor as it
    is."""
    llama = config.architecture in ("llama", "mixtral")  # GGUF architecture llama
    if llama and (".attn_q." in name or ".attn_k." in name):
        return _unpermute_rotary(w, config.head_dim)
    return w


class GGUFTensor(StoredTensor):
    """One tensor of a GGUF file, read from its map: any range of rows, and of columns in whole
    blocks of its type (a range inside a block decodes the blocks it touches, then drops the
    columns outside it). With `as_groups`, read as the quantized layers' groups (gguf_blocks.py),
    else dequantized to `dtype`."""

    def __init__(
        self,
        tensor: ReaderTensor,
        shape: tuple[int, ...],
        config: ModelConfig,
        dtype: torch.dtype,
        as_groups: bool,
        where: str,
        expert: int | None = None,
    ) -> None:
        self.tensor, self.shape, self.config = tensor, shape, config
        self.dtype, self.as_groups, self.where = dtype, as_groups, where
        # Of a 3-D tensor of stacked experts: the one this is, read as a view of its bytes.
        self.expert = expert

    def _blocks(self, rows: slice, cols: slice) -> tuple[np.ndarray, int, slice]:
        """The stored data covering `rows` x `cols`, its width in weights, and `cols` in it."""
        data = self.tensor.data if self.expert is None else self.tensor.data[self.expert]
        data = data[rows]
        if data.ndim == 1:
            return data, len(data), ALL
        # The reader gives float tensors as their elements, every other type as bytes per row.
        block, size = gguf.GGML_QUANT_SIZES[self.tensor.tensor_type]
        if data.dtype != np.uint8:
            block, size = 1, 1
        k = range(self.shape[1])[cols]
        first, end = k.start // block, -(-k.stop // block)
        inside = slice(k.start - first * block, k.stop - first * block)
        return data[:, first * size : end * size], (end - first) * block, inside

    def read(self, rows: slice = ALL, cols: slice = ALL) -> torch.Tensor | GroupQuantized:
        data, width, inside = self._blocks(rows, cols)
        qtype, name = self.tensor.tensor_type, self.tensor.name
        if self.as_groups:
            try:
                w = groups(data, qtype, (len(data), width))
            except ValueError as e:
                raise ModelLoadError(f"{self.where}: tensor {name!r}: {e}") from None
            return w.columns(inside).map_rows(lambda t: _rotary_rows(t, name, self.config))
        values = gguf.quants.dequantize(data, qtype)
        # A copy off the read-only map, of the columns asked for only.
        w = torch.from_numpy(np.array(values[..., inside], dtype=np.float32))
        return _rotary_rows(w, name, self.config).to(self.dtype)


def gguf_tensors(
    reader: gguf.GGUFReader,
    config: ModelConfig,
    dtype: torch.dtype = torch.float32,
    keep_quantized: bool = False,
) -> dict[str, GGUFTensor]:
    """Every tensor by its Hugging Face name and shape, checked against `config` but not read:
    dequantized to `dtype` when read, except, with `keep_quantized`, the quantized ones, read as
    groups for the quantized linear layers at their KERNEL_BITS (loaders/gguf_blocks.py: most
    as stored, never dequantized)."""
    expected = _tensor_names(config)
    where = _where(reader)
    tensors: dict[str, GGUFTensor] = {}
    for tensor in reader.tensors:
        if tensor.name in CONFIG_TENSORS:
            continue  # already folded into config.rope_scaling
        if tensor.name not in expected:
            raise UnsupportedModelError(f"{where}: unexpected tensor {tensor.name!r}")
        if tensor.tensor_type not in SUPPORTED_TENSOR_TYPES:
            raise UnsupportedModelError(
                f"{where}: tensor {tensor.name!r} has unsupported type {tensor.tensor_type.name}; "
                f"tinyllm reads {', '.join(t.name for t in SUPPORTED_TENSOR_TYPES)}"
            )
        hf_name, shape = expected[tensor.name]
        stored = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims fastest first
        if stored != shape:
            raise ModelLoadError(
                f"{where}: tensor {tensor.name!r} has shape {stored}, config implies {shape}"
            )
        as_groups = keep_quantized and tensor.tensor_type in KERNEL_BITS
        if "{}" in hf_name:  # stacked experts: one tensor each, viewing the file's bytes
            for e in range(shape[0]):
                args = (shape[1:], config, dtype, as_groups, where, e)
                tensors[hf_name.format(e)] = GGUFTensor(tensor, *args)
        else:
            tensors[hf_name] = GGUFTensor(tensor, shape, config, dtype, as_groups, where)
    # A stacked tensor's experts, or each expert's own (Mixtral's older files): either will do.
    missing = [hf_name for hf_name, _ in expected.values() if hf_name.format(0) not in tensors]
    if missing:
        raise ModelLoadError(f"{where}: missing tensors {', '.join(missing[:5])}")
    return tensors


def stored_bits(reader: gguf.GGUFReader) -> set[int]:
    """The kernel bits (KERNEL_BITS) of the file's quantized weight matrices."""
    return {KERNEL_BITS[t.tensor_type] for t in reader.tensors if t.tensor_type in KERNEL_BITS}
