"""Every option of `LLM` and of the engine's commands, declared once: the option fields
(host/options.py) of LoadConfig, LLMOptions and EngineConfig. `LLM` splits its keyword arguments
by these fields; the command line makes its flags from them (entrypoints/args.py). No torch here,
so that the help stays light."""

import dataclasses
from dataclasses import dataclass

from tinyllm.engine.config import EngineConfig
from tinyllm.entrypoints.generation_config import (
    DEFAULT_MAX_TOKENS,
    GENERATION_CONFIGS,
    check_generation_config,
)
from tinyllm.host.options import option, option_fields
from tinyllm.host.threads import default_threads
from tinyllm.loaders.load_config import LoadConfig
from tinyllm.text.reasoning import REASONING_PARSERS
from tinyllm.text.tool_parsers import TOOL_CALL_PARSERS


@dataclass(frozen=True)
class LLMOptions:
    """LLM's own options, beside LoadConfig's and EngineConfig's. LLM's `threads` is each rank's
    (None: torch's own choice; under tensor parallelism, each rank's share of the cores); the
    --threads flag is the host's, which build_llm shares among the ranks on the host."""

    device: str | None = option(None, "cpu or cuda (default: cuda if available)")
    threads: int | None = option(
        None,
        "torch CPU threads (default: OMP_NUM_THREADS if set, else the cores this process may "
        f"use: {default_threads()} here), shared by the tensor-parallel ranks on this host",
    )
    generation_config: str = option(
        "auto",
        "sampling defaults for what a request leaves unset; auto: the model's recommended "
        f"settings, else greedy, up to {DEFAULT_MAX_TOKENS} tokens; vllm: SamplingParams' "
        "neutral ones (temperature 1, 16 tokens)",
        choices=GENERATION_CONFIGS,
    )
    tool_call_parser: str = option(
        "auto",
        "the format of tool calls (constrained and parsed); auto: the one the chat template "
        "teaches, else hermes (<tool_call> blocks)",
        choices=TOOL_CALL_PARSERS,
    )
    reasoning_parser: str = option(
        "auto",
        "how a thinking model's <think> part is kept apart from its answer: auto (a model "
        "thinks if its chat template writes <think>, or gpt-oss's harmony format), none "
        "(never: all is answer), qwen3, deepseek_r1 (the answer starts inside the thinking), "
        "openai_gptoss (harmony's analysis channel)",
        choices=REASONING_PARSERS,
    )
    reasoning_budget: int | None = option(
        None,
        "the most tokens a thinking model may think before it answers, where a chat request "
        "sets none (thinking_token_budget) (default: no limit)",
    )

    def __post_init__(self) -> None:
        check_generation_config(self.generation_config)
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"tool_call_parser: {self.tool_call_parser!r} is not one of "
                f"{', '.join(TOOL_CALL_PARSERS)}"
            )
        if self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"reasoning_parser={self.reasoning_parser!r}: use one of "
                + ", ".join(REASONING_PARSERS)
            )
        if self.reasoning_budget is not None and self.reasoning_budget < 0:
            raise ValueError(f"reasoning_budget={self.reasoning_budget} must be >= 0")


# Every option's class, in the order of the help: what to load, this process, the engine.
OPTION_CLASSES = (LoadConfig, LLMOptions, EngineConfig)


def llm_configs(options: dict[str, object]) -> tuple[LLMOptions, LoadConfig, EngineConfig]:
    """LLM's keyword arguments as its configs, each argument to the config with a field of its
    name: LLMOptions' and LoadConfig's options, EngineConfig's fields. A name none of them has
    is a TypeError that names it; a bad value, the config's ValueError."""
    own, load = ({f.name for f in option_fields(cls)} for cls in (LLMOptions, LoadConfig))
    engine = {f.name for f in dataclasses.fields(EngineConfig)}
    unknown = sorted(set(options) - own - load - engine)
    if unknown:
        raise TypeError(
            f"LLM() got unknown option(s) {', '.join(unknown)}: LLM takes the fields of "
            "LoadConfig, LLMOptions and EngineConfig (tinyllm/entrypoints/llm_options.py)"
        )

    def pick(names: set[str]) -> dict[str, object]:
        return {name: value for name, value in options.items() if name in names}

    engine_config = EngineConfig(**pick(engine))
    load_config = LoadConfig(**pick(load), max_model_len=engine_config.max_model_len)
    return LLMOptions(**pick(own)), load_config, engine_config
