"""Sliding-window attention against transformers (eager attention, which applies the window as
a mask): tiny random Mistral checkpoints whose window (8 keys) is far shorter than their prompts
and generations, from safetensors and from GGUF, in fp32 and on the int4 kernels, through the
model runner and through the engine with chunked prefill; Qwen2's window on the layers
max_window_layers picks; how each config reaches ModelConfig; the CUDA backend's refusal. The
kernel against the reference backend: tests/test_attention_cpu.py."""

from dataclasses import replace
from pathlib import Path

import gguf
import pytest
import torch

from tests.greedy import assert_greedy_close, top_dicts
from tests.model_runs import checkpoint_weights, load, prompt_logits, transformers_logits
from tests.test_gguf_loader import write_gguf
from tests.test_hf_loader import BASE, _random_hf_model, _write_config, _write_tokenizer
from tests.test_kquant import tinyllm_model
from tests.test_model_families import GGUF_DIMS, hf_greedy, prompts, tinyllm_dense
from tinyllm import LLM, SamplingParams
from tinyllm.loaders.gguf import gguf_config, open_gguf
from tinyllm.loaders.hf import hf_config
from tinyllm.model.attention import cuda
from tinyllm.model.attention.reference import ReferenceBackend
from tinyllm.model.attention.select import get_backend
from tinyllm.model.config import ModelLoadError

Q = gguf.GGMLQuantizationType
WINDOW = 8
LENGTHS = (37, 29, 5)  # past the window, and within it


def random_model(family: str = "Mistral", **overrides) -> torch.nn.Module:
    return _random_hf_model(family, sliding_window=WINDOW, attn_implementation="eager", **overrides)


def without_window(reference: torch.nn.Module) -> torch.nn.Module:
    """The same weights attending to the whole context."""
    config = reference.config.to_dict() | {"sliding_window": None, "use_sliding_window": False}
    config.pop("layer_types", None)
    full = type(reference)(type(reference.config)(**config)).eval()
    full.load_state_dict(reference.state_dict())
    return full


def assert_matches(ours: list[torch.Tensor], reference, batch, tolerance: float = 1e-4) -> None:
    """`ours` against transformers on each prompt, and the window mattered: transformers over
    the whole context agrees within the window and not past it."""
    full = without_window(reference)
    for prompt, logits in zip(batch, ours, strict=True):
        expected = transformers_logits(reference, prompt)
        assert expected.std() > 0.3
        torch.testing.assert_close(logits, expected, atol=tolerance, rtol=tolerance)
        whole = transformers_logits(full, prompt)
        torch.testing.assert_close(whole[:WINDOW], expected[:WINDOW], atol=1e-4, rtol=1e-4)
        if len(prompt) > WINDOW + 1:
            assert (whole[WINDOW + 1 :] - expected[WINDOW + 1 :]).abs().max() > 0.1


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_mistral_checkpoint_matches_transformers(backend: str, tmp_path: Path) -> None:
    """All prompts in one flat batch: the cpu backend runs whole layers as C++ ops."""
    reference = random_model()
    reference.save_pretrained(tmp_path)
    config = hf_config(tmp_path)
    assert (config.sliding_window, config.sliding_window_layers) == (WINDOW, None)
    batch = prompts(*LENGTHS)
    assert_matches(prompt_logits(tinyllm_dense(tmp_path), batch, backend=backend), reference, batch)


def test_qwen2_window_on_the_layers_from_max_window_layers(tmp_path: Path) -> None:
    """transformers slides Qwen2's layers from max_window_layers on (here layer 1 of 2) and
    attends to the whole context in the others."""
    reference = random_model("Qwen2", use_sliding_window=True, max_window_layers=1)
    reference.save_pretrained(tmp_path)
    config = hf_config(tmp_path)
    assert (config.sliding_window, config.sliding_window_layers) == (WINDOW, (1,))
    model = tinyllm_dense(tmp_path)
    assert [layer.self_attn.window for layer in model.model.layers] == [None, WINDOW]
    batch = prompts(*LENGTHS)
    assert_matches(prompt_logits(model, batch), reference, batch)


def hf_greedy_top(model: torch.nn.Module, prompt: list[int], n: int, k: int = 5):
    """transformers' greedy tokens and each step's top-k logprobs (the chosen one's included)."""
    ids, tops = list(prompt), []
    for _ in range(n):
        logprobs = transformers_logits(model, ids)[-1].log_softmax(-1)
        top = logprobs.topk(k)
        tops.append(dict(zip(top.indices.tolist(), top.values.tolist(), strict=True)))
        ids.append(int(top.indices[0]))
    return ids[len(prompt) :], tops


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("mistral")
    reference = random_model()
    reference.save_pretrained(path)
    _write_tokenizer(path)
    return path, reference


def test_engine_with_chunked_prefill_matches_transformers(mistral_dir) -> None:
    """fp32 through LLM: prompts prefilled in chunks of 16 tokens (2-3 per prompt), then 20
    decoded tokens each, all past the window: transformers' greedy tokens, and its logprob
    of every prompt token."""
    path, reference = mistral_dir
    llm = LLM(str(path), "float32", quantization="none", max_num_batched_tokens=16)
    batch = prompts(*LENGTHS)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, prompt_logprobs=0)
    for prompt, out in zip(batch, llm.generate(batch, params, use_tqdm=False), strict=True):
        assert list(out.outputs[0].token_ids) == hf_greedy(reference, prompt, 20)
        expected = transformers_logits(reference, prompt).log_softmax(-1)
        for p, lp in enumerate(out.prompt_logprobs[1:]):
            assert lp.logprob == pytest.approx(expected[p, prompt[p + 1]].item(), abs=1e-4)


def test_int4_engine_with_chunked_prefill_is_close_to_transformers(mistral_dir) -> None:
    """The int4 kernels on the fused C++ layers, prompts chunked: greedy outputs by vLLM's rule
    for quantized weights (the same tokens up to the first difference, each side's choice
    there in the other's top 5)."""
    path, reference = mistral_dir
    llm = LLM(str(path), "float32", quantization="int4", max_num_batched_tokens=16)
    assert llm.engine.model.model.layers[0].self_attn.qkv_proj.bits == 4
    batch = prompts(*LENGTHS)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=5)
    outs = llm.generate(batch, params, use_tqdm=False)
    for i, (prompt, out) in enumerate(zip(batch, outs, strict=True)):
        ids, tops = hf_greedy_top(reference, prompt, 20)
        ours = out.outputs[0]
        assert_greedy_close(ids, tops, ours.token_ids, top_dicts(ours.logprobs), f"#{i}", None)


def mistral_gguf(path: Path, reference: torch.nn.Module, qtype: Q, window: int) -> Path:
    """`reference`'s weights as llama.cpp writes a Mistral: architecture llama, and the window
    under llama.attention.sliding_window."""
    weights = {k: v.numpy() for k, v in reference.state_dict().items()}
    metadata = {"llama.attention.sliding_window": window}
    return write_gguf(path, weights, "llama", qtype, metadata)


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q4_0])
def test_mistral_gguf_matches_transformers(qtype: Q, tmp_path: Path) -> None:
    """From GGUF, dense (F32) and on the int4 kernels as stored (Q4_0, against transformers on
    the file's dequantized weights: only the activations' rounding to 8 bits differs)."""
    reference = random_model(**GGUF_DIMS, rms_norm_eps=1e-5)  # write_gguf's
    path = mistral_gguf(tmp_path / "m.gguf", reference, qtype, WINDOW)
    model = load(path)  # fp32, dense: the file's weights dequantized
    assert (model.config.architecture, model.config.sliding_window) == ("llama", WINDOW)
    reference.load_state_dict(checkpoint_weights(model))
    if qtype != Q.F32:
        model = tinyllm_model(path)
        assert model.model.layers[0].self_attn.qkv_proj.bits == 4
    batch = prompts(*LENGTHS, vocab=GGUF_DIMS["vocab_size"])
    ours = prompt_logits(model, batch)
    if qtype == Q.F32:
        assert_matches(ours, reference, batch)
        return
    for prompt, logits in zip(batch, ours, strict=True):
        expected = transformers_logits(reference, prompt)
        torch.testing.assert_close(logits, expected, rtol=0, atol=0.01 * expected.std().item())
        assert logits.argmax(-1).equal(expected.argmax(-1))


@pytest.mark.parametrize(("window", "expected"), [(0, None), (WINDOW, WINDOW), (256, None)])
def test_gguf_window_reaches_the_config(window: int, expected: int | None, tmp_path: Path):
    """0 (no window) and a window at least the file's context (256) leave attention full."""
    path = write_gguf(tmp_path / "m.gguf", {}, metadata={"llama.attention.sliding_window": window})
    config = gguf_config(open_gguf(path))
    assert config.sliding_window == expected and config.max_position_embeddings == 256


def test_hf_configs_reach_the_config(tmp_path: Path) -> None:
    def read(name: str, **cfg):
        config = hf_config(_write_config(tmp_path / name, **cfg))
        return config.sliding_window, config.sliding_window_layers

    assert read("m", model_type="mistral", sliding_window=32) == (32, None)
    context = BASE["max_position_embeddings"]
    assert read("wide", model_type="mistral", sliding_window=context) == (None, None)
    assert read("none", model_type="mistral", sliding_window=None) == (None, None)
    # Llama has no window in transformers, whatever its config says.
    assert read("llama", model_type="llama", sliding_window=32) == (None, None)
    # Qwen's window is off unless use_sliding_window; then from max_window_layers (default 28,
    # past these 2 layers: none slides), or where layer_types says.
    assert read("q", model_type="qwen2", sliding_window=32) == (None, None)
    on = dict(sliding_window=32, use_sliding_window=True)
    assert read("q0", model_type="qwen2", max_window_layers=0, **on) == (32, (0, 1))
    assert read("q28", model_type="qwen3", head_dim=32, **on) == (None, None)
    types = ["sliding_attention", "full_attention"]
    assert read("qt", model_type="qwen3", head_dim=32, layer_types=types, **on) == (32, (0,))
    with pytest.raises(ModelLoadError, match="layer_types has 1 entries for 2 layers"):
        read("bad", model_type="qwen2", layer_types=types[:1], **on)
    with pytest.raises(ModelLoadError, match="sliding_window -4 must be >= 1"):
        replace(hf_config(_write_config(tmp_path / "neg", model_type="mistral")), sliding_window=-4)


def test_the_cuda_backend_refuses_a_window(monkeypatch, caplog) -> None:
    """Its Triton kernel attends to the whole context: `auto` takes the reference instead,
    with a warning; asking for it by name is an error naming the window."""
    monkeypatch.setattr(cuda, "load_cuda_backend", lambda: (cuda.CudaBackend(None), "ok"))
    gpu = torch.device("cuda")
    assert isinstance(get_backend("auto", gpu), cuda.CudaBackend)
    assert isinstance(get_backend("auto", gpu, WINDOW), ReferenceBackend)
    assert f"sliding_window={WINDOW}" in caplog.text
    with pytest.raises(
        ValueError,
        match=f"cuda backend has no sliding window, and the model sets sliding_window={WINDOW}",
    ):
        get_backend("cuda", gpu, WINDOW)
