"""`tinyllm bench`: the benchmarks a user runs.

- `tinyllm bench WORKLOAD` (offline.py): a named workload in-process, against a baseline and the
  machine's own limits, all measured in the same run;
- `tinyllm bench serve` (serve.py): the online benchmark, streaming requests to any
  OpenAI-compatible server, reported as `vllm bench serve` reports it.
"""

import importlib

__all__ = ["best_seconds", "read_bandwidth", "gemm_flops"]


def __getattr__(name: str):
    # The machine measurements, for the scripts in benchmarks/; imported on first use so that
    # `tinyllm bench serve` (an HTTP client) does not pay for importing torch.
    if name in __all__:
        return getattr(importlib.import_module("tinyllm.entrypoints.bench.machine"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
