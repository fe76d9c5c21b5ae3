"""--load-format dummy: a model from a config alone, with random weights in its run format."""

import json
import re

import httpx
import pytest
import torch

from tinyllm.engine.sampling_params import SamplingParams
from tinyllm.engine.structured_output.params import StructuredOutputsParams
from tinyllm.loaders.dummy import dummy_config, dummy_weights, named_configs, parameter_count
from tinyllm.model.config import ModelLoadError, UnsupportedModelError
from tinyllm.model.quant import GroupQuantized, describe_weights

TINY = {
    "model_type": "qwen3",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 300,
    "max_position_embeddings": 128,
    "tie_word_embeddings": True,
}
# The published parameter counts (model cards / safetensors metadata; Qwen3-1.7B's checkpoint
# stores its tied head twice, 2.03B, and has 1.72B distinct parameters).
KNOWN_PARAMETERS = {
    "qwen2.5-0.5b": 494_032_768,
    "llama-3.2-1b": 1_235_814_400,
    "qwen3-1.7b": 1_720_574_976,
    "llama-3.1-8b": 8_030_261_248,
    # Gemma 3 4B's text model: its checkpoint's 4.3B also count the SigLIP vision tower (0.42B).
    "gemma-3-4b": 3_880_263_168,
    # The MoE models' published totals (their model cards: 6.9B, 30.5B, 46.7B, 21B).
    "olmoe-1b-7b": 6.9e9,
    "qwen3-30b-a3b": 30.5e9,
    "mixtral-8x7b": 46.7e9,
    "gpt-oss-20b": 21e9,
}


def _write(tmp_path, **changes) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TINY, **changes}))
    return str(path)


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory) -> str:
    return _write(tmp_path_factory.mktemp("dummy"))


def _greedy(llm, n: int = 5) -> list[int]:
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    return llm.generate([[5, 17, 42, 7]], params, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize(
    ("quantization", "runs_as"), [("auto", "int4"), ("int8", "int8"), ("none", "dense")]
)
def test_a_config_json_runs_greedy_tokens_in_each_format(tiny_config, quantization, runs_as):
    from tinyllm import LLM

    def load():
        return LLM(
            tiny_config,
            load_format="dummy",
            quantization=quantization,
            dtype="float32",
            num_blocks=32,
            max_num_seqs=4,
        )

    llm = load()
    assert describe_weights(llm.engine.model).startswith(f"{runs_as} weights")
    tokens = _greedy(llm)
    assert len(tokens) == 5 and all(0 <= t < TINY["vocab_size"] for t in tokens)
    assert _greedy(load()) == tokens  # seeded: the same weights every time
    with pytest.raises(ValueError, match="without a tokenizer: give prompts as token ids"):
        llm.generate("hello")
    with pytest.raises(ValueError, match="without a tokenizer"):
        llm.chat([{"role": "user", "content": "hi"}])


def test_quantized_dummy_weights_are_blocks_of_plausible_scale(tiny_config):
    """Codes over the whole grid, weights centred with std near 1/sqrt(in_features) (what keeps
    activations at scale through the layers); the LM head in 8 bits, as int4 mode runs it."""
    _, _, config = dummy_config(tiny_config)
    weights = dummy_weights(config, "int4", torch.float32)
    w = weights["model.layers.0.mlp.down_proj.weight"]
    assert isinstance(w, GroupQuantized) and w.bits == 4
    assert w.shape == (64, 128) and w.q.min() == 0 and w.q.max() == 15
    dense = w.dequantize()
    assert abs(dense.mean()) < 0.1 * 128**-0.5
    assert 0.7 < dense.std() / 128**-0.5 < 1.3
    assert weights["model.embed_tokens.weight"].bits == 8  # tied: the head's 8-bit rows
    dense_weights = dummy_weights(config, "none", torch.bfloat16)
    assert dense_weights["model.layers.1.self_attn.qkv_proj.weight"].dtype == torch.bfloat16


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"model_type": "qwen2", "tie_word_embeddings": False},  # q/k/v biases, an untied head
        {"model_type": "llama", "head_dim": 32, "num_key_value_heads": 4},
        {"model_type": "gemma3_text"},  # q/k norms and four norms a layer
    ],
)
def test_parameter_count_is_what_the_weights_hold(tmp_path, changes):
    _, _, config = dummy_config(_write(tmp_path, **changes))
    weights = dummy_weights(config, "none", torch.float32)
    assert parameter_count(config) == sum(t.numel() for t in weights.values())


@pytest.mark.parametrize("name", sorted(KNOWN_PARAMETERS))
def test_named_configs_have_their_real_models_parameter_count(name):
    _, _, config = dummy_config(name)
    assert parameter_count(config) == pytest.approx(KNOWN_PARAMETERS[name], rel=0.01)


def test_named_configs_are_the_ones_the_cli_lists():
    from tinyllm.loaders.load_config import DUMMY_CONFIGS

    assert set(named_configs()) == set(DUMMY_CONFIGS) == set(KNOWN_PARAMETERS)
    assert dummy_config("qwen3-1.7b")[2].qk_norm  # Qwen3's q/k norms, which the model runs
    assert dummy_config("llama-3.1-8b")[2].rope_scaling["rope_type"] == "llama3"


@pytest.mark.parametrize(
    ("model", "changes", "error", "message"),
    [
        ("llama-9b", None, ModelLoadError, "no such config 'llama-9b'; give .*llama-3.2-1b"),
        (None, None, ModelLoadError, "needs a model config"),
        ("file", {"hidden_size": -64}, ModelLoadError, "hidden_size must be a positive integer"),
        ("file", {"model_type": "gemma"}, UnsupportedModelError, "model_type 'gemma'"),
        ("file", {"hidden_act": "gelu"}, UnsupportedModelError, "hidden_act 'gelu'"),
    ],
)
def test_bad_configs_name_the_problem(tmp_path, model, changes, error, message):
    if changes is not None:
        model = _write(tmp_path, **changes)
    with pytest.raises(error, match=message):
        dummy_config(model)


def test_a_config_lacking_a_field_names_it(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({k: v for k, v in TINY.items() if k != "intermediate_size"}))
    with pytest.raises(ModelLoadError, match="lacks 'intermediate_size'"):
        dummy_config(str(path))


def test_quantized_shapes_must_fill_whole_groups(tmp_path):
    _, _, config = dummy_config(_write(tmp_path, hidden_size=48, intermediate_size=100))
    with pytest.raises(ModelLoadError, match="groups of 32: hidden_size=48, intermediate_size=100"):
        dummy_weights(config, "int4", torch.float32)


def test_weights_that_would_not_fit_memory_are_refused_before_allocating(monkeypatch):
    import tinyllm.loaders.dummy as dummy

    monkeypatch.setattr(dummy, "available_bytes", lambda device: 2**30)
    _, _, config = dummy_config("llama-3.1-8b")
    with pytest.raises(ModelLoadError, match=r"8\.03B parameters in dense float32 need about 29"):
        dummy_weights(config, "none", torch.float32)
    # int4: the packed blocks, their fp32 scales while packing, the dense bf16 embedding table
    with pytest.raises(ModelLoadError, match=r"in int4 need about 7\.1 GiB, more than the 1\.0"):
        dummy_weights(config, "int4", torch.bfloat16)


def test_bench_runs_dummy_weights_without_the_transformers_baseline():
    from tinyllm.entrypoints.bench.offline import baseline_for

    assert baseline_for("single", "auto", dummy=True) == "none"
    assert baseline_for("shared-prefix", "auto", dummy=True) == "no-prefix-caching"
    with pytest.raises(ValueError, match="needs the model's real weights, not dummy"):
        baseline_for("offline", "transformers", dummy=True)


def test_cli_generate_with_dummy_weights_says_why_it_cannot(tiny_config, capsys):
    from tinyllm.entrypoints.cli import main

    argv = ["generate", "hi", "--load-format", "dummy", "--model", tiny_config, "--num-blocks", "8"]
    assert main(argv) == 1
    assert "without a tokenizer" in capsys.readouterr().err


def test_an_unknown_load_format_is_refused_before_loading():
    from tinyllm import LLM

    with pytest.raises(ValueError, match="load_format='pt': choose auto or dummy"):
        LLM(load_format="pt")


@pytest.fixture(scope="module")
def dummy_llm(tiny_config):
    from tinyllm import LLM

    return LLM(tiny_config, load_format="dummy", dtype="float32", num_blocks=32, max_num_seqs=4)


def test_structured_output_with_dummy_weights_says_they_have_no_tokenizer(dummy_llm):
    """A grammar is over text, which dummy weights lack: the error says so, nothing is queued."""
    constrained = SamplingParams(
        max_tokens=3, structured_outputs=StructuredOutputsParams(regex="a+")
    )
    with pytest.raises(ValueError, match=r"dummy.*without a tokenizer.*structured output"):
        dummy_llm.generate([[5, 17], [42, 7]], [SamplingParams(max_tokens=3), constrained])
    assert not dummy_llm.engine.has_unfinished()
    tools = [{"type": "function", "function": {"name": "f"}}]
    with pytest.raises(ValueError, match="without a tokenizer"):
        dummy_llm.chat([{"role": "user", "content": "hi"}], tools=tools)
    assert len(_greedy(dummy_llm)) == 5  # it goes on serving token ids


def test_the_server_refuses_structured_output_with_dummy_weights_naming_why(dummy_llm):
    from tests.http_server import serving
    from tinyllm.entrypoints.server.app import create_app

    with serving(create_app(dummy_llm)) as url:
        body = {"prompt": [5, 17], "max_tokens": 3, "response_format": {"type": "json_object"}}
        r = httpx.post(f"{url}/v1/completions", json=body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "response_format"
        assert re.search(r"dummy.*without a tokenizer.*structured output", error["message"])
        body = {"prompt": [5, 17], "structured_outputs": {"choice": ["a", "b"]}}
        r = httpx.post(f"{url}/v1/completions", json=body)
        assert r.status_code == 400 and "without a tokenizer" in r.text, r.text
        r = httpx.post(
            f"{url}/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"type": "function", "function": {"name": "f"}}],
            },
        )
        assert r.status_code == 400 and "without a tokenizer" in r.text, r.text
        r = httpx.post(f"{url}/v1/completions", json={"prompt": [5, 17], "max_tokens": 2})
        assert r.status_code == 200, r.text
