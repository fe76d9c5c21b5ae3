"""Sampling defaults: the model's recommended settings, tinyllm's fallback, and a field the
request sets always winning (Python API, CLI flags, server requests)."""

import dataclasses
import json
from pathlib import Path

import gguf
import pytest

from tests.test_hf_loader import _random_hf_model, _save, _write_tokenizer
from tinyllm import LLM, SamplingParams
from tinyllm.engine.config import EngineConfig
from tinyllm.engine.engine import LLMEngine
from tinyllm.entrypoints import cli
from tinyllm.entrypoints import llm as llm_module
from tinyllm.entrypoints.generation_config import default_sampling, model_recommendations
from tinyllm.entrypoints.server.engine_requests import Prompt, plan_choices
from tinyllm.entrypoints.server.protocol import CompletionRequest

HF_GENERATION_CONFIG = {
    "bos_token_id": 1,
    "eos_token_id": 2,
    "do_sample": True,
    "temperature": 0.6,
    "top_p": 0.9,
    "top_k": 20,
    "max_new_tokens": 100,
}


def _hf_dir(tmp_path: Path, generation_config: dict | None) -> Path:
    path = _save(_random_hf_model("Llama"), tmp_path / "llama-tiny", sharded=False)
    _write_tokenizer(path)
    (path / "generation_config.json").unlink(missing_ok=True)
    if generation_config is not None:
        (path / "generation_config.json").write_text(json.dumps(generation_config))
    return path


def test_hf_generation_config_gives_the_defaults(tmp_path):
    path = tmp_path / "model"
    path.mkdir()
    (path / "generation_config.json").write_text(json.dumps(HF_GENERATION_CONFIG))
    expected = {"temperature": 0.6, "top_k": 20, "top_p": 0.9, "max_tokens": 100}
    assert model_recommendations(path) == expected
    assert default_sampling("auto", path) == expected
    assert default_sampling("vllm", path) == {}


def test_a_model_without_recommendations_gets_tinyllms_defaults(tmp_path):
    path = tmp_path / "model"
    path.mkdir()
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1}))
    assert default_sampling("auto", path) == {"max_tokens": 512, "temperature": 0.0}
    # Only a length: still no sampling settings, so still greedy.
    (path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 64}))
    assert default_sampling("auto", path) == {"max_tokens": 64, "temperature": 0.0}


def test_some_sampling_settings_mean_hf_defaults_for_the_rest(tmp_path):
    """top_p alone is a sampling recommendation (HF's temperature 1.0), not greedy + top_p."""
    path = tmp_path / "model"
    path.mkdir()
    (path / "generation_config.json").write_text(json.dumps({"top_p": 0.8}))
    assert default_sampling("auto", path) == {"max_tokens": 512, "top_p": 0.8}


def test_gguf_sampling_metadata(tmp_path):
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_float32("general.sampling.temp", 0.7)
    writer.add_int32("general.sampling.top_k", 40)
    writer.add_float32("general.sampling.top_p", 0.95)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert model_recommendations(path) == {"temperature": 0.7, "top_k": 40, "top_p": 0.95}


def test_the_default_model_carries_none(default_gguf_path):
    """SmolLM2's GGUF has no general.sampling keys (and its package no generation_config), so
    tinyllm's documented defaults apply."""
    assert model_recommendations(default_gguf_path) == {}


def test_llm_applies_the_models_defaults_unless_params_are_given(tmp_path):
    # Greedy and 3 tokens by the model's recommendation: deterministic to compare.
    path = _hf_dir(tmp_path, {"temperature": 0.0, "max_new_tokens": 3})
    llm = LLM(str(path), device="cpu", max_model_len=64)
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=3)
    prompt = "w5 w6 w7"
    by_default = llm.generate(prompt, use_tqdm=False)[0].outputs[0]
    explicit = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert by_default.token_ids == explicit[0].outputs[0].token_ids
    neutral = LLM(str(path), device="cpu", max_model_len=64, generation_config="vllm")
    assert neutral.get_default_sampling_params() == SamplingParams()


def test_invalid_recommendations_name_the_file_and_the_way_out(tmp_path):
    path = _hf_dir(tmp_path, {"top_p": 0.0})
    with pytest.raises(ValueError, match="recommended sampling settings are invalid.*vllm"):
        LLM(str(path), device="cpu")


def test_unknown_generation_config_fails_before_loading(monkeypatch):
    monkeypatch.setattr(llm_module, "load_model", lambda *a, **k: pytest.fail("loaded"))
    with pytest.raises(ValueError, match="generation_config='hf': choose auto or vllm"):
        LLM(generation_config="hf")


class _FakeLLM:
    def get_default_sampling_params(self) -> SamplingParams:
        return SamplingParams(temperature=0.6, top_p=0.9, top_k=20, max_tokens=100)


def test_cli_flags_the_user_typed_win_and_the_rest_are_the_models():
    args = cli.build_parser().parse_args(["generate", "Hi", "--temperature", "1", "--top-k", "0"])
    params = cli._params(_FakeLLM(), args)
    # 1.0 and 0 are SamplingParams' own defaults: typed, they still win over the model's.
    assert (params.temperature, params.top_k) == (1.0, 0)
    assert (params.top_p, params.max_tokens) == (0.9, 100)


def test_server_request_fields_win_and_the_rest_are_the_models(tiny):
    model, tokenizer = tiny
    engine = LLMEngine(model, tokenizer, EngineConfig(num_blocks=16))
    defaults = _FakeLLM().get_default_sampling_params()
    req = CompletionRequest(prompt="t2 t3", temperature=1.0, top_k=5)
    [choice] = plan_choices(
        engine.request_validator(), "cmpl-1", req, [Prompt([2, 3])], None, 30, None, defaults
    )
    expected = dataclasses.replace(defaults, temperature=1.0, top_k=5, max_tokens=30)
    assert dataclasses.replace(choice.params, output_kind=expected.output_kind) == expected
