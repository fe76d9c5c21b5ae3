"""Hugging Face model directories: config.json -> ModelConfig, safetensors -> tensors by name."""

import json
import math
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from tinyllm.loaders.hf_encoders import ENCODER_CLASSES, encoder_config, encoder_tensor_name
from tinyllm.loaders.hf_experts import ROUTER, STACKED_EXPERTS, stacked_expert_tensors
from tinyllm.loaders.pooling_config import apply_pooling_config
from tinyllm.loaders.stored import ALL, StoredTensor, covers
from tinyllm.model.config import (
    ENCODER_ARCHITECTURES,
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    ModelLoadError,
    UnsupportedModelError,
    serve_within_window,
    unsupported_architecture,
)

_ARCH_BY_CLASS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "OlmoeForCausalLM": "olmoe",
    "GptOssForCausalLM": "gpt_oss",
} | ENCODER_CLASSES
# Hugging Face model_types that are a supported architecture under another name.
_MODEL_TYPE_ALIASES = {"gemma3_text": "gemma3"}
_GEMMA = ("gemma2", "gemma3")
# What transformers' Gemma2Config and Gemma3TextConfig assume for keys a config.json leaves out
# (Gemma 3's own configs give little beyond the sizes that differ from the 1B's).
_GEMMA_DEFAULTS = {
    "gemma2": dict(
        vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=8192,
        query_pre_attn_scalar=256, sliding_window=4096, final_logit_softcapping=30.0,
        attn_logit_softcapping=50.0, tie_word_embeddings=True, sliding_window_pattern=2,
    ),
    "gemma3": dict(
        vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256,
        max_position_embeddings=131072, query_pre_attn_scalar=256, sliding_window=4096,
        rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, tie_word_embeddings=True,
        sliding_window_pattern=6,
    ),
}  # fmt: skip
# What transformers' GptOssConfig assumes for keys a config.json leaves out.
_GPT_OSS_DEFAULTS = dict(
    rope_theta=150000.0, sliding_window=128, swiglu_limit=7.0, attention_bias=True,
    rope_scaling=dict(
        rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
        original_max_position_embeddings=4096,
    ),
)  # fmt: skip
# A Gemma 3 vision-language checkpoint's text model, under the text model's own names; the
# vision tower and projector are not loaded.
_TEXT_MODEL_PREFIXES = {
    "language_model.model.": "model.",
    "model.language_model.": "model.",
    "language_model.lm_head.": "lm_head.",
}
_VISION_PREFIXES = tuple(
    f"{outer}{part}."
    for outer in ("", "model.")
    for part in ("vision_tower", "multi_modal_projector")
)
# Kept in step with model.Rope: checked here so an unsupported model fails before its weights load.
_ROPE_TYPES = (None, "default", "llama3", "linear", "longrope", "yarn")
# Phi-3's configs written before transformers named LongRoPE (transformers reads them the same).
_PHI3_LONGROPE_ALIASES = ("su", "yarn")
# Buffers some checkpoints saved alongside the weights; tinyllm recomputes them.
_UNUSED_SUFFIXES = ("rotary_emb.inv_freq",)
# Mixtral's checkpoints name its experts' layer block_sparse_moe and their gate, down and up
# projections w1, w2 and w3; the model uses the other MoE families' names.
_MIXTRAL_NAMES = re.compile(r"\.block_sparse_moe\.(?:(gate)|experts\.(\d+)\.(w[123]))\.")
_MIXTRAL_EXPERT = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{path} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path} is not readable JSON: {e}") from e


def _architecture(cfg: dict) -> str:
    model_type = cfg.get("model_type")
    names = cfg.get("architectures") or []
    if model_type is None:
        model_type = next((_ARCH_BY_CLASS[n] for n in names if n in _ARCH_BY_CLASS), None)
        if model_type is None:
            raise unsupported_architecture(" or ".join(names) or "a config without model_type", "")
    model_type = _MODEL_TYPE_ALIASES.get(model_type, model_type)
    if model_type not in SUPPORTED_ARCHITECTURES:
        name = f"{names[0]} (model_type {model_type!r})" if names else f"model_type {model_type!r}"
        raise unsupported_architecture(name, model_type)
    return model_type


def _longrope(params: dict, cfg: dict) -> dict:
    """Phi-3's LongRoPE parameters, with the attention factor transformers derives when the
    config does not give one (from `factor`, else the context's growth over the pretrained one)."""
    # Phi-3's configs keep the pretrained context beside rope_scaling, not in it.
    params = {"original_max_position_embeddings": cfg.get("original_max_position_embeddings")} | {
        k: v for k, v in params.items() if v is not None
    }
    for key in ("original_max_position_embeddings", "short_factor", "long_factor"):
        if params.get(key) is None:
            raise ModelLoadError(f"longrope rope scaling lacks {key!r}")
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or cfg["max_position_embeddings"] / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        grown = factor > 1
        attention_factor = math.sqrt(1 + math.log(factor) / math.log(original)) if grown else 1.0
    return {
        "rope_type": "longrope",
        "short_factor": params["short_factor"],
        "long_factor": params["long_factor"],
        "original_max_position_embeddings": original,
        "attention_factor": attention_factor,
    }


def _rope(cfg: dict, arch: str) -> tuple[float, dict | None, float]:
    """(theta, scaling, partial_rotary_factor): transformers 5 keeps them in `rope_parameters`,
    older configs split them into `rope_theta`, `rope_scaling` and `partial_rotary_factor`."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    kind = params.get("rope_type", params.get("type"))
    if arch == "phi3" and kind in _PHI3_LONGROPE_ALIASES:
        kind = "longrope"
    if kind not in _ROPE_TYPES:
        raise UnsupportedModelError(
            f"unsupported rope scaling {kind!r}; tinyllm supports llama3, linear, longrope and yarn"
        )
    if kind == "longrope":
        return theta, _longrope(params, cfg), partial
    if kind == "yarn" and params.get("factor") is None:
        raise ModelLoadError("yarn rope scaling lacks 'factor'")
    drop = ("rope_theta", "partial_rotary_factor")
    scaling = {k: v for k, v in params.items() if k not in drop}
    if kind == "yarn":  # transformers' default for the pretrained context
        scaling.setdefault("original_max_position_embeddings", cfg["max_position_embeddings"])
    return theta, (scaling if kind not in (None, "default") else None), partial


def _sliding_window(cfg: dict, config: ModelConfig) -> None:
    """A sliding window shorter than the context, as transformers applies it: Mistral's on every
    layer; Qwen2's and Qwen3's only with use_sliding_window, on the layers its layer_types mark
    (by default those from max_window_layers on). Phi-3's is served by cutting the context to it
    instead: full attention is the same there, and cheaper."""
    window, arch = cfg.get("sliding_window"), config.architecture
    qwen = arch in ("qwen2", "qwen3")
    active = arch in ("mistral", "mixtral", "phi3") or (
        qwen and cfg.get("use_sliding_window", False)
    )
    if not (active and window and window < config.max_position_embeddings):
        return
    if arch == "phi3":
        serve_within_window(config, window)
        return
    layers = None
    if qwen:
        n = config.num_layers
        types = cfg.get("layer_types") or [
            "sliding_attention" if i >= cfg.get("max_window_layers", 28) else "full_attention"
            for i in range(n)
        ]  # 28: transformers' default for both
        if len(types) != n:
            raise ModelLoadError(f"layer_types has {len(types)} entries for {n} layers")
        layers = tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")
        if not layers:
            return
    config.sliding_window, config.sliding_window_layers = window, layers


def _gemma_config(cfg: dict, arch: str) -> dict:
    """A Gemma 2 or Gemma 3 config with transformers' defaults filled in, Gemma 3's text part of
    a vision-language config (Gemma3ForConditionalGeneration) lifted out of its text_config."""
    if "text_config" in cfg:
        top = {"tie_word_embeddings": cfg.get("tie_word_embeddings", True)}
        cfg = {**top, **cfg["text_config"], "architectures": cfg.get("architectures")}
    # A null soft-capping means none (Gemma 3's); any other null, transformers' default.
    return _GEMMA_DEFAULTS[arch] | {k: v for k, v in cfg.items() if v is not None or "soft" in k}


def _gemma_rope(cfg: dict) -> tuple[float, dict | None, float | None]:
    """Gemma 3's (theta, scaling) of its global layers and the base of its sliding ones:
    transformers 5's rope_parameters has a dict per layer type, older configs rope_theta,
    rope_scaling and rope_local_base_freq."""
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params:
        local = params.get("sliding_attention") or {}
        local_theta = local.get("rope_theta", cfg["rope_local_base_freq"])
        if local.get("rope_type", "default") != "default":
            raise UnsupportedModelError("Gemma 3's sliding layers take plain RoPE, no scaling")
        cfg = {k: v for k, v in cfg.items() if k != "rope_parameters"}
        cfg["rope_parameters"] = params["full_attention"]
    else:
        local_theta = cfg["rope_local_base_freq"]
    theta, scaling, _ = _rope(cfg, "gemma3")
    return theta, scaling, float(local_theta)


def _gemma_fields(cfg: dict, config: ModelConfig) -> None:
    """Gemma's own fields of `config`, and its sliding layers: layer_types where the config
    has them, else transformers' pattern (every other layer for Gemma 2, 5 of 6 for Gemma 3)."""
    n, pattern = config.num_layers, cfg["sliding_window_pattern"]
    types = cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)
    ]
    if len(types) != n:
        raise ModelLoadError(f"layer_types has {len(types)} entries for {n} layers")
    config.sliding_window = cfg["sliding_window"]
    config.sliding_window_layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    config.hidden_act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    config.embedding_scale = config.hidden_size**0.5
    config.post_norms = True
    config.attn_logit_softcapping = cfg.get("attn_logit_softcapping")
    config.final_logit_softcapping = cfg.get("final_logit_softcapping")
    config.query_pre_attn_scalar = float(cfg["query_pre_attn_scalar"])
    config.__post_init__()  # checks hidden_act and the window


def _gpt_oss_fields(cfg: dict, config: ModelConfig) -> None:
    """gpt-oss's own fields of `config`: biases on q/k/v and o, attention sinks, a sliding window
    on the layers layer_types marks (by default every other one, from the first)."""
    quant = (cfg.get("quantization_config") or {}).get("quant_method")
    if quant not in (None, "mxfp4"):
        raise UnsupportedModelError(f"gpt-oss quantized by {quant!r}: tinyllm reads mxfp4")
    n = config.num_layers
    types = cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)
    ]
    if len(types) != n:
        raise ModelLoadError(f"layer_types has {len(types)} entries for {n} layers")
    layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if cfg["sliding_window"] and layers:
        config.sliding_window, config.sliding_window_layers = cfg["sliding_window"], layers
    config.o_proj_bias = config.attention_bias
    config.attention_sinks = True
    config.__post_init__()  # checks the window


def hf_config(model_dir: str | Path) -> ModelConfig:
    """Read `config.json` of a Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2, Gemma 3, Qwen3-MoE,
    Mixtral, OLMoE, gpt-oss, BERT or XLM-RoBERTa checkpoint (`model_dir` is its directory, or
    the file itself), with the pooling its sentence-transformers files give."""
    path = Path(model_dir)
    path = path if path.is_file() else path / "config.json"
    cfg = _read_json(path)
    arch = _architecture(cfg)
    try:
        config = (
            encoder_config(cfg, arch, path.parent)
            if arch in ENCODER_ARCHITECTURES
            else _decoder_config(cfg, arch)
        )
    except KeyError as e:
        raise ModelLoadError(f"{path} lacks {e.args[0]!r}") from None
    apply_pooling_config(path.parent, config)
    return config


def _decoder_config(cfg: dict, arch: str) -> ModelConfig:
    """The decoders' config.json (hf_config's): their fields as transformers reads them."""
    gemma = arch in _GEMMA
    if gemma:
        cfg = _gemma_config(cfg, arch)
    if arch == "gpt_oss":
        cfg = _GPT_OSS_DEFAULTS | {k: v for k, v in cfg.items() if v is not None}
    elif cfg.get("hidden_act", "silu") not in ("silu", "swish"):
        raise UnsupportedModelError(f"unsupported hidden_act {cfg['hidden_act']!r}; needs silu")
    if arch == "gemma3":
        (theta, scaling, local_theta), partial = _gemma_rope(cfg), 1.0
    else:
        (theta, scaling, partial), local_theta = _rope(cfg, arch), None
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    config = ModelConfig(
        architecture=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        max_position_embeddings=cfg["max_position_embeddings"],
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        # Qwen2 always has q/k/v biases and its config does not say so.
        attention_bias=arch == "qwen2" or cfg.get("attention_bias", False),
        qk_norm=arch in ("qwen3", "gemma3", "qwen3_moe", "olmoe"),
        qk_norm_all_heads=arch == "olmoe",
        **_experts(cfg, arch),
        # Phi-4-mini rotates 3/4 of each head; transformers rounds the count down.
        rotary_dim=int(head_dim * partial) if partial != 1 else None,
        rope_local_theta=local_theta,
    )
    if gemma:
        _gemma_fields(cfg, config)
    elif arch == "gpt_oss":
        _gpt_oss_fields(cfg, config)
    else:
        _sliding_window(cfg, config)
    return config


def _experts(cfg: dict, arch: str) -> dict:
    """ModelConfig's mixture-of-experts fields, as transformers reads them: Qwen3-MoE's experts
    on the layers decoder_sparse_step marks and not in mlp_only_layers; Mixtral's and OLMoE's
    on every layer. Mixtral always renormalises its top-k; the others by norm_topk_prob. gpt-oss:
    biases, the softmax of the top-k logits, the clamped SwiGLU (swiglu_limit, swiglu_alpha)."""
    if arch == "gpt_oss":
        return {
            "num_experts": cfg["num_local_experts"],
            "num_experts_per_tok": cfg["num_experts_per_tok"],
            "moe_intermediate_size": cfg["intermediate_size"],
            "moe_bias": True,
            "softmax_after_topk": True,
            "swiglu_limit": float(cfg["swiglu_limit"]),
            "swiglu_alpha": float(cfg.get("swiglu_alpha", 1.702)),
        }
    if arch not in ("qwen3_moe", "mixtral", "olmoe"):
        return {}
    if arch == "olmoe" and cfg.get("clip_qkv") is not None:
        raise UnsupportedModelError("OLMoE with clip_qkv (clamped q/k/v) is not supported")
    dense = ()
    if arch == "qwen3_moe":
        step, only = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or ())
        n = cfg["num_hidden_layers"]
        dense = tuple(i for i in range(n) if i in only or (i + 1) % step)
    return {
        "num_experts": cfg.get("num_experts") or cfg["num_local_experts"],
        "num_experts_per_tok": cfg["num_experts_per_tok"],
        "moe_intermediate_size": cfg.get("moe_intermediate_size") or cfg["intermediate_size"],
        "norm_topk_prob": arch == "mixtral" or cfg.get("norm_topk_prob", False),
        "dense_mlp_layers": dense,
    }


def hf_stored_bits(model_dir: Path) -> set[int]:
    """{8} for a checkpoint whose experts are MXFP4 (read as exact 8-bit groups, loaders/mxfp4.py),
    so that quantization "auto" keeps them as stored; else none."""
    cfg = _read_json(model_dir / "config.json")
    mxfp4 = (cfg.get("quantization_config") or {}).get("quant_method") == "mxfp4"
    return {8} if mxfp4 else set()


def _shard_map(model_dir: Path) -> dict[str, list[str] | None]:
    """File name -> tensor names to read from it (None: all of them)."""
    single, index = model_dir / "model.safetensors", model_dir / "model.safetensors.index.json"
    if single.is_file():
        return {single.name: None}
    if not index.is_file():
        raise ModelLoadError(f"{model_dir} has neither {single.name} nor {index.name}")
    weight_map = _read_json(index).get("weight_map")
    if not isinstance(weight_map, dict):
        raise ModelLoadError(f"{index} has no weight_map")
    shards: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        shards.setdefault(shard, []).append(name)
    missing = sorted(s for s in shards if not (model_dir / s).is_file())
    if missing:
        raise ModelLoadError(f"{index} names shard(s) missing from {model_dir}: {missing}")
    return shards


class SafetensorsTensor(StoredTensor):
    """One tensor of a safetensors file, read from its map: only the rows and columns asked
    for; floating point ones converted to `dtype`, with `plus_one` after adding 1 in fp32 (a
    Gemma norm's weight w, which scales by 1 + w: the model holds that multiplier)."""

    def __init__(
        self, file: safe_open, name: str, path: Path, dtype: torch.dtype, plus_one: bool = False
    ) -> None:
        self.file, self.name, self.path, self.dtype = file, name, path, dtype
        self.plus_one = plus_one
        self.shape = tuple(file.get_slice(name).get_shape())

    def read(self, rows: slice = ALL, cols: slice = ALL) -> Tensor:
        try:
            if covers(self.shape, rows, cols):
                t = self.file.get_tensor(self.name)
            else:
                part = self.file.get_slice(self.name)
                t = (part[rows] if len(self.shape) == 1 else part[rows, cols]).contiguous()
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"cannot read {self.path}: {e}") from e
        if self.plus_one:
            t = t.float() + 1
        return t.to(self.dtype) if t.is_floating_point() else t


def _model_name(name: str) -> str:
    """A checkpoint's tensor name as the model names it (Mixtral's experts and gpt-oss's
    router renamed)."""

    def rename(m: re.Match) -> str:
        gate, expert, w = m.groups()
        return ".mlp.gate." if gate else f".mlp.experts.{expert}.{_MIXTRAL_EXPERT[w]}."

    return ROUTER.sub(".mlp.gate.", _MIXTRAL_NAMES.sub(rename, name))


def _own_name(name: str) -> str | None:
    """The model's name for a checkpoint's tensor: a vision-language checkpoint's text model's
    under the text model's names; None for its vision tower and projector and unused buffers."""
    if name.startswith(_VISION_PREFIXES) or name.endswith(_UNUSED_SUFFIXES):
        return None
    for prefix, own in _TEXT_MODEL_PREFIXES.items():
        if name.startswith(prefix):
            return own + name.removeprefix(prefix)
    return name


def hf_tensors(
    model_dir: str | Path, dtype: torch.dtype, config: ModelConfig | None = None
) -> dict[str, SafetensorsTensor]:
    """Every tensor of the checkpoint the model uses, opened but not read (see
    SafetensorsTensor), by the model's names; `config` (hf_config's) says whether its norms
    scale by 1 + w (Gemma's) and how many experts a stacked tensor holds (gpt-oss's, see
    loaders/hf_experts.py)."""
    model_dir = Path(model_dir)
    plus_one = config is not None and config.architecture in _GEMMA
    encoder = config is not None and not config.is_causal
    tensors: dict[str, SafetensorsTensor] = {}
    for shard, names in _shard_map(model_dir).items():
        path = model_dir / shard
        try:
            file = safe_open(path, framework="pt")
            for name in names if names is not None else file.keys():
                if encoder:
                    own = encoder_tensor_name(name, config.num_labels > 0)
                else:
                    own = _own_name(name)
                if own is not None and STACKED_EXPERTS.fullmatch(own) and config is not None:
                    experts = stacked_expert_tensors(file, path, own, config.num_experts, dtype)
                    tensors.update(experts)
                elif own is not None:
                    norm = plus_one and own.endswith("norm.weight")
                    tensors[_model_name(own)] = SafetensorsTensor(file, name, path, dtype, norm)
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"cannot read {path}: {e}") from e
    return tensors
