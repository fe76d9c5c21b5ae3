from pathlib import Path

import pytest

from tinyllm.loaders.source import default_model_path


@pytest.fixture(scope="session")
def default_gguf_path() -> Path:
    """The default model (SmolLM2-135M-Instruct Q4_1), shipped inside a PyPI package. Missing
    is an error naming the install command, not a skip: CI installs it."""
    return default_model_path()


@pytest.fixture(scope="session")
def default_llm(default_gguf_path):
    """The default model loaded once for every test that runs it (engines can share it)."""
    from tinyllm import LLM

    return LLM(str(default_gguf_path), num_blocks=1024, max_model_len=2048)
