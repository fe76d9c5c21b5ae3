"""Hugging Face model directories: config.json -> ModelConfig, safetensors -> tensors by name."""

import json
import math
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from tinyllm.loaders.stored import ALL, StoredTensor, covers
from tinyllm.model.config import (
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
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "OlmoeForCausalLM": "olmoe",
}
# Kept in step with model.Rope: checked here so an unsupported model fails before its weights load.
_ROPE_TYPES = (None, "default", "llama3", "linear", "longrope")
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
            f"unsupported rope scaling {kind!r}; tinyllm supports llama3, linear and longrope"
        )
    if kind == "longrope":
        return theta, _longrope(params, cfg), partial
    drop = ("rope_theta", "partial_rotary_factor")
    scaling = {k: v for k, v in params.items() if k not in drop}
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


def hf_config(model_dir: str | Path) -> ModelConfig:
    """Read `config.json` of a Llama, Mistral, Qwen2, Qwen3, Phi-3, Qwen3-MoE, Mixtral or OLMoE
    checkpoint (`model_dir` is its directory, or the file itself)."""
    path = Path(model_dir)
    path = path if path.is_file() else path / "config.json"
    cfg = _read_json(path)
    arch = _architecture(cfg)
    if cfg.get("hidden_act", "silu") not in ("silu", "swish"):
        raise UnsupportedModelError(f"unsupported hidden_act {cfg['hidden_act']!r}; needs silu")
    try:
        theta, scaling, partial = _rope(cfg, arch)
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
            qk_norm=arch in ("qwen3", "qwen3_moe", "olmoe"),
            qk_norm_all_heads=arch == "olmoe",
            **_experts(cfg, arch),
            # Phi-4-mini rotates 3/4 of each head; transformers rounds the count down.
            rotary_dim=int(head_dim * partial) if partial != 1 else None,
        )
    except KeyError as e:
        raise ModelLoadError(f"{path} lacks {e.args[0]!r}") from None
    _sliding_window(cfg, config)
    return config


def _experts(cfg: dict, arch: str) -> dict:
    """ModelConfig's mixture-of-experts fields, as transformers reads them: Qwen3-MoE's experts
    on the layers decoder_sparse_step marks and not in mlp_only_layers; Mixtral's and OLMoE's
    on every layer. Mixtral always renormalises its top-k; the others by norm_topk_prob."""
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
    for; floating point ones converted to `dtype`."""

    def __init__(self, file: safe_open, name: str, path: Path, dtype: torch.dtype) -> None:
        self.file, self.name, self.path, self.dtype = file, name, path, dtype
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
        return t.to(self.dtype) if t.is_floating_point() else t


def _model_name(name: str) -> str:
    """A checkpoint's tensor name as the model names it (Mixtral's experts renamed)."""

    def rename(m: re.Match) -> str:
        gate, expert, w = m.groups()
        return ".mlp.gate." if gate else f".mlp.experts.{expert}.{_MIXTRAL_EXPERT[w]}."

    return _MIXTRAL_NAMES.sub(rename, name)


def hf_tensors(model_dir: str | Path, dtype: torch.dtype) -> dict[str, SafetensorsTensor]:
    """Every tensor of the checkpoint the model uses, opened but not read (see
    SafetensorsTensor)."""
    model_dir = Path(model_dir)
    tensors: dict[str, SafetensorsTensor] = {}
    for shard, names in _shard_map(model_dir).items():
        path = model_dir / shard
        try:
            file = safe_open(path, framework="pt")
            for name in names if names is not None else file.keys():
                if not name.endswith(_UNUSED_SUFFIXES):
                    tensors[_model_name(name)] = SafetensorsTensor(file, name, path, dtype)
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"cannot read {path}: {e}") from e
    return tensors
