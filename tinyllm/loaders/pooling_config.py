"""A sentence-transformers model directory's pooling: modules.json lists its modules
(Transformer, Pooling, Normalize), 1_Pooling/config.json says how token states become one
vector, sentence_bert_config.json how many tokens it reads, config_sentence_transformers.json
the prompts put before inputs. Read for every architecture: a Qwen3-Embedding directory is a
Qwen3 decoder with last-token pooling, a Normalize module and a "query" instruction prompt."""

import json
from pathlib import Path

from tinyllm.model.config import ModelConfig, ModelLoadError, UnsupportedModelError

# sentence-transformers' pooling modes -> ModelConfig.pooling; its other modes (max,
# mean_sqrt_len_tokens, weightedmean) tinyllm's pooler does not compute.
_MODES = {"cls": "cls", "mean": "mean", "lasttoken": "last"}
# Its older configs' one flag per mode (pooling_mode_cls_token: true, ...).
_LEGACY_FLAGS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_lasttoken": "lasttoken",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
}
_KNOWN_MODULES = ("Transformer", "Pooling", "Normalize")


def _json(path: Path) -> dict | list:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path} is not readable JSON: {e}") from e


def _pooling_mode(path: Path) -> str:
    """ModelConfig.pooling for a Pooling module's config.json."""
    cfg = _json(path)
    mode = cfg.get("pooling_mode")
    if mode is None:  # the older format
        mode = [m for flag, m in _LEGACY_FLAGS.items() if cfg.get(flag)]
    modes = [mode] if isinstance(mode, str) else list(mode)
    if len(modes) != 1 or modes[0] not in _MODES:
        raise UnsupportedModelError(
            f"{path}: pooling {modes}; tinyllm pools by one of {', '.join(_MODES)}"
        )
    if modes[0] == "mean" and cfg.get("include_prompt") is False:
        raise UnsupportedModelError(f"{path}: mean pooling without the prompt is not supported")
    return _MODES[modes[0]]


def apply_pooling_config(model_dir: Path, config: ModelConfig) -> None:
    """Set `config`'s pooling and normalize from `model_dir`'s modules.json, its prompts from
    config_sentence_transformers.json, and cap its context at sentence_bert_config.json's
    max_seq_length; a directory without them is left as it is."""
    modules_path = model_dir / "modules.json"
    if not modules_path.is_file():
        return
    modules = _json(modules_path)
    if not isinstance(modules, list):
        raise ModelLoadError(f"{modules_path} is not a list of modules")
    for module in modules:
        kind = str(module.get("type", "")).rpartition(".")[2]
        if kind not in _KNOWN_MODULES:
            raise UnsupportedModelError(
                f"{modules_path}: module {module.get('type')!r} (tinyllm runs "
                f"{', '.join(_KNOWN_MODULES)})"
            )
        if kind == "Pooling":
            config.pooling = _pooling_mode(model_dir / module.get("path", "") / "config.json")
        config.normalize = config.normalize or kind == "Normalize"
    _apply_prompts(model_dir / "config_sentence_transformers.json", config)
    bert_config = model_dir / "sentence_bert_config.json"
    length = _json(bert_config).get("max_seq_length") if bert_config.is_file() else None
    if length:
        config.max_position_embeddings = min(config.max_position_embeddings, length)


def _apply_prompts(path: Path, config: ModelConfig) -> None:
    """sentence-transformers' named prompts and default prompt name, where the file has them."""
    if not path.is_file():
        return
    cfg = _json(path)
    prompts, default = cfg.get("prompts") or {}, cfg.get("default_prompt_name")
    if not isinstance(prompts, dict) or not all(isinstance(v, str) for v in prompts.values()):
        raise ModelLoadError(f"{path}: prompts must map names to texts")
    if default is not None and default not in prompts:
        raise ModelLoadError(
            f"{path}: default_prompt_name {default!r} is not one of its prompts {list(prompts)}"
        )
    config.prompts, config.default_prompt_name = dict(prompts), default
