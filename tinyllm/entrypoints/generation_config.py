"""Default sampling settings: the model's recommended ones, as vLLM's `--generation-config auto`.

A request (a CLI flag, a field of an HTTP request) that sets a field always wins; a field it
leaves out takes, in order:
1. the model's recommendation: `generation_config.json` beside Hugging Face weights, or a GGUF's
   `general.sampling.*` metadata (llama.cpp's keys);
2. tinyllm's defaults: `max_tokens` 512, so an answer is not cut off at SamplingParams' 16
   tokens, and greedy when the model recommends no sampling settings at all;
3. SamplingParams' own neutral values (temperature 1.0, max_tokens 16).
`generation_config="vllm"` skips 1 and 2: the neutral values only.

Greedy is tinyllm's default because small chat models answer most reliably with it: the default
model answers README's questions completely and correctly greedy, while at temperature 0.2 it
sometimes loops until max_tokens.
"""

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from tinyllm.model.config import ModelLoadError

if TYPE_CHECKING:
    import gguf

log = logging.getLogger("tinyllm")

GENERATION_CONFIGS = ("auto", "vllm")
DEFAULT_MAX_TOKENS = 512
# For a model that recommends no sampling settings at all.
DEFAULT_SAMPLING: dict[str, object] = {"temperature": 0.0}

# generation_config.json key -> SamplingParams field: the keys vLLM reads.
_HF_KEYS = {
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
# A GGUF's recommended sampling (written by llama.cpp's convert script from the same JSON).
_GGUF_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_k": "top_k",
    "general.sampling.top_p": "top_p",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


def model_recommendations(path: Path, reader: "gguf.GGUFReader | None" = None) -> dict[str, object]:
    """The sampling settings the model at `path` (a .gguf file or an HF directory) recommends,
    as SamplingParams fields; empty when it carries none. `reader`: the file, already open (a
    second parse of a large vocabulary costs seconds)."""
    if path.is_file():
        return _from_gguf(reader or _open(path))
    config = path / "generation_config.json"
    if not config.is_file():
        return {}
    try:
        raw = json.loads(config.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{config} is not readable JSON: {e}") from e
    return {field: raw[key] for key, field in _HF_KEYS.items() if raw.get(key) is not None}


def _open(path: Path) -> "gguf.GGUFReader":
    import gguf

    return gguf.GGUFReader(path)


def _from_gguf(reader: "gguf.GGUFReader") -> dict[str, object]:
    out = {}
    for key, field in _GGUF_KEYS.items():
        value = reader.get_field(key)
        if value is not None:
            # float32 in the file: 0.9 reads back as 0.8999999761581421
            out[field] = round(value.contents(), 6)
    return out


def check_generation_config(generation_config: str) -> None:
    if generation_config not in GENERATION_CONFIGS:
        raise ValueError(
            f"generation_config={generation_config!r}: choose {' or '.join(GENERATION_CONFIGS)}"
        )


def default_sampling(
    generation_config: str, path: Path, reader: "gguf.GGUFReader | None" = None
) -> dict[str, object]:
    """The SamplingParams fields a request that leaves them out gets, for the model at `path`
    (`reader`: its GGUF file, already open)."""
    if generation_config == "vllm":
        return {}
    model = model_recommendations(path, reader)
    defaults: dict[str, object] = {"max_tokens": DEFAULT_MAX_TOKENS}
    # A model that recommends some sampling settings means HF's defaults for the others (so
    # temperature 1.0): our greedy fallback would go against its intent.
    if set(model) <= {"max_tokens"}:
        defaults |= DEFAULT_SAMPLING
    defaults |= model
    log.info(
        "sampling defaults: %s (%s)",
        ", ".join(f"{k}={v}" for k, v in defaults.items()),
        "the model's where it recommends them, else tinyllm's" if model else "tinyllm's",
    )
    return defaults
