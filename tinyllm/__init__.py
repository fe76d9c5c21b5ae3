"""tinyllm: a small, readable, fast LLM inference engine."""

import importlib

__all__ = [
    "LLM",
    "SamplingParams",
    "PoolingParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
]
__version__ = "0.1.0"

_HOMES = {
    "LLM": "tinyllm.entrypoints.llm",
    "SamplingParams": "tinyllm.engine.sampling_params",
    "PoolingParams": "tinyllm.engine.pooling_params",
    "StructuredOutputsParams": "tinyllm.engine.structured_output.params",
    "RequestOutput": "tinyllm.engine.outputs",
    "CompletionOutput": "tinyllm.engine.outputs",
}


def __getattr__(name: str):
    # Imported on first use, so `import tinyllm.model.config` (or the CLI's --help) stays light.
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'tinyllm' has no attribute {name!r}")
