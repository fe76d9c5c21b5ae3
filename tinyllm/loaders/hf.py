"""Hugging Face model directories: config.json -> ModelConfig, safetensors -> state dict."""

import json
import logging
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from tinyllm.model.config import (
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    ModelLoadError,
    UnsupportedModelError,
)

log = logging.getLogger(__name__)

_ARCH_BY_CLASS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
# Kept in step with model.Rope: checked here so an unsupported model fails before its weights load.
_ROPE_TYPES = (None, "default", "llama3", "linear")
# Buffers some checkpoints saved alongside the weights; tinyllm recomputes them.
_UNUSED_SUFFIXES = ("rotary_emb.inv_freq",)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{path} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path} is not readable JSON: {e}") from e


def _architecture(cfg: dict) -> str:
    model_type = cfg.get("model_type")
    if model_type is None:
        names = cfg.get("architectures") or []
        model_type = next((_ARCH_BY_CLASS[n] for n in names if n in _ARCH_BY_CLASS), None)
        if model_type is None:
            raise UnsupportedModelError(
                f"unsupported architectures {names}; tinyllm runs {', '.join(_ARCH_BY_CLASS)}"
            )
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported model_type {model_type!r}; "
            f"tinyllm runs {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return model_type


def _rope(cfg: dict) -> tuple[float, dict | None]:
    """(theta, scaling): transformers 5 keeps both in `rope_parameters`, older configs split them
    into `rope_theta` and `rope_scaling`."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type"))
    if kind not in _ROPE_TYPES:
        raise UnsupportedModelError(
            f"unsupported rope scaling {kind!r}; tinyllm supports llama3 and linear"
        )
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    return theta, (scaling if kind not in (None, "default") else None)


def hf_config(model_dir: str | Path) -> ModelConfig:
    """Read `config.json` of a Llama, Mistral, Qwen2 or Qwen3 checkpoint (`model_dir` is its
    directory, or the file itself)."""
    path = Path(model_dir)
    path = path if path.is_file() else path / "config.json"
    cfg = _read_json(path)
    arch = _architecture(cfg)
    if cfg.get("hidden_act", "silu") not in ("silu", "swish"):
        raise UnsupportedModelError(f"unsupported hidden_act {cfg['hidden_act']!r}; needs silu")
    theta, scaling = _rope(cfg)
    try:
        heads = cfg["num_attention_heads"]
        max_pos = cfg["max_position_embeddings"]
        config = ModelConfig(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            max_position_embeddings=max_pos,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            # Qwen2 always has q/k/v biases and its config does not say so.
            attention_bias=arch == "qwen2" or cfg.get("attention_bias", False),
            qk_norm=arch == "qwen3",
        )
    except KeyError as e:
        raise ModelLoadError(f"{path} lacks {e.args[0]!r}") from None
    window = cfg.get("sliding_window")
    # Qwen configs carry a window they leave switched off unless use_sliding_window is set.
    active = arch == "mistral" or cfg.get("use_sliding_window", False)
    if active and window and window < max_pos:
        config.extra["sliding_window"] = window
        log.warning(
            "%s sets sliding_window=%d; tinyllm attends to the full context, so outputs "
            "differ from the reference past %d tokens",
            arch,
            window,
            window,
        )
    return config


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


def hf_weights(model_dir: str | Path, dtype: torch.dtype) -> dict[str, Tensor]:
    """Every tensor of the checkpoint the model uses, floating point ones converted to `dtype`."""
    model_dir = Path(model_dir)
    weights: dict[str, Tensor] = {}
    for shard, names in _shard_map(model_dir).items():
        path = model_dir / shard
        try:
            with safe_open(path, framework="pt") as f:
                for name in names if names is not None else f.keys():
                    if name.endswith(_UNUSED_SUFFIXES):
                        continue
                    t = f.get_tensor(name)
                    weights[name] = t.to(dtype) if t.is_floating_point() else t
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"cannot read {path}: {e}") from e
    return weights
