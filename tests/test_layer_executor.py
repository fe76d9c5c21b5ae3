"""The layer executor: chosen once by the model runner (auto, or forced by layer_executor), logged
with why, refused where "fused" cannot run, set on the model and obeyed by its layers.
test_decoder_layer checks that the two executors agree."""

import logging

import pytest
import torch

from tests.test_decoder_layer import BLOCK, PROMPTS, _model
from tinyllm.engine.config import EngineConfig
from tinyllm.engine.engine import LLMEngine
from tinyllm.engine.sampling_params import SamplingParams
from tinyllm.engine.sched.kv_cache_manager import KVCacheManager
from tinyllm.engine.sched.request import Request
from tinyllm.engine.sched.scheduler import step_message
from tinyllm.engine.worker.model_runner import ModelRunner
from tinyllm.entrypoints import cli
from tinyllm.model import llama
from tinyllm.model.attention import get_backend
from tinyllm.model.config import ModelConfig
from tinyllm.model.cpu_library import library_error

needs_library = pytest.mark.skipif(
    library_error() is not None, reason=f"CPU library did not build: {library_error()}"
)


def _runner(model: llama.Transformer, backend: str, executor: str = "auto") -> ModelRunner:
    backend = get_backend(backend, model.device)
    return ModelRunner(model, 4, BLOCK, backend, executor)


@needs_library
def test_auto_runs_fused_layers_on_the_cpu_backend(caplog):
    model = _model("llama", "int4", torch.float32)
    with caplog.at_level(logging.INFO, logger="tinyllm"):
        assert _runner(model, "cpu").model.layer_executor == "fused"
    assert "layer executor: fused (" in caplog.text


@pytest.mark.parametrize(
    "backend,dtype,why",
    [
        ("reference", torch.float32, "the reference attention backend"),
        ("cpu", torch.float16, "float16 activations"),
    ],
)
def test_auto_runs_modules_where_fused_cannot_run_and_fused_is_refused(backend, dtype, why, caplog):
    model = _model("llama", "none", dtype)
    with caplog.at_level(logging.INFO, logger="tinyllm"):
        assert _runner(model, backend).model.layer_executor == "modules"
    assert f"layer executor: modules ({why}" in caplog.text
    with pytest.raises(ValueError, match=f"layer_executor='fused' cannot run here: {why}"):
        _runner(model, backend, "fused")


def test_fused_is_refused_off_the_cpu():
    with torch.device("meta"):
        model = llama.Transformer(ModelConfig("llama", 96, 64, 80, 2, 4, 2, 16, 64))
    with pytest.raises(ValueError, match="cannot run here: the model is on meta, and the fused"):
        ModelRunner(model, 4, BLOCK, get_backend("reference", model.device), "fused")


def test_an_unknown_executor_is_refused():
    model = _model("llama", "none", torch.float32)
    with pytest.raises(ValueError, match="layer_executor='fast': choose one of auto, fused, mod"):
        _runner(model, "reference", "fast")


@needs_library
@pytest.mark.parametrize("executor", ["fused", "modules"])
def test_the_model_runs_the_executor_the_runner_chose(executor, monkeypatch):
    """Each executor's run never enters the other's code: the fused one no forward of a layer's
    modules (norms, attention, MLP, projections), the modules one no decoder op."""
    model = _model("llama", "int4", torch.float32)
    runner = _runner(model, "cpu", executor)
    assert all(layer.fused == (executor == "fused") for layer in model.model.layers)

    def other(*args):
        raise AssertionError(f"{executor} ran the other executor's code")

    if executor == "fused":
        for layer in model.model.layers:
            for module in layer.modules():
                if module is not layer:
                    monkeypatch.setattr(module, "forward", other)
    else:
        for op in ("decoder_attention", "decoder_mlp"):
            monkeypatch.setattr(torch.ops.tinyllm, op, other)
    kv = KVCacheManager(runner.scratch, BLOCK)
    r = Request("0", PROMPTS[0], SamplingParams(max_tokens=1), 1, [], seed=0)
    assert kv.allocate(r, r.num_tokens)
    batch = runner.prepare_inputs(step_message([(r, r.num_tokens)]))
    assert model(batch.input_ids, batch.positions, batch.ctx).shape == (7, 64)


def test_set_layer_executor_takes_only_the_two_executors():
    model = _model("llama", "none", torch.float32)
    with pytest.raises(ValueError, match="layer executor 'auto': 'fused' or 'modules'"):
        model.set_layer_executor("auto")


@needs_library
def test_the_engine_config_reaches_the_runner(tiny):
    model, tokenizer = tiny
    assert LLMEngine(model, tokenizer, EngineConfig()).runner.model.layer_executor == "fused"
    config = EngineConfig(layer_executor="modules")
    assert LLMEngine(model, tokenizer, config).runner.model.layer_executor == "modules"
    config = EngineConfig(attention_backend="reference", layer_executor="fused")
    with pytest.raises(ValueError, match="'fused' cannot run here: the reference attention"):
        LLMEngine(model, tokenizer, config)


@pytest.mark.parametrize(
    "flag,executor", [([], "auto"), (["--layer-executor", "modules"], "modules")]
)
def test_the_flag_reaches_the_llm(monkeypatch, flag, executor):
    from tinyllm.entrypoints import args as args_module
    from tinyllm.entrypoints import llm as llm_module

    seen = {}
    monkeypatch.setattr(llm_module, "LLM", lambda **kwargs: seen.update(kwargs))
    args_module.build_llm(cli.build_parser().parse_args(["generate", "Hi", *flag]))
    assert seen["layer_executor"] == executor
