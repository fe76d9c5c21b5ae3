"""Families close to Llama: Phi-3 (stacked q|k|v and gate|up in the checkpoint, LongRoPE, partial
rotary, its sliding window) from a Hugging Face directory and from GGUF against transformers; and
the families tinyllm refuses (Gemma 1, Phi-2, anything unknown), in one line naming them
(Gemma 2 and 3: tests/test_gemma.py)."""

import json
import logging
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file

from tests.model_runs import checkpoint_weights, load, prompt_logits, transformers_logits
from tests.test_gguf_loader import write_gguf
from tests.test_hf_loader import BASE, _random_hf_model, _write_tokenizer
from tests.test_kquant import tinyllm_model
from tinyllm.entrypoints import cli
from tinyllm.loaders.gguf import gguf_config, open_gguf
from tinyllm.loaders.hf import hf_config
from tinyllm.loaders.source import open_checkpoint
from tinyllm.model.config import ModelLoadError, UnsupportedModelError
from tinyllm.model.llama import Transformer

Q = gguf.GGMLQuantizationType
ORIGINAL = 16  # original_max_position_embeddings: prompts longer than this cross it
_factors = np.random.default_rng(3)


def longrope(rotated: int) -> dict:
    """LongRoPE factors for `rotated` dims: short ones near 1, long ones stretching up to 8x."""
    n = rotated // 2
    return {
        "rope_type": "longrope",
        "short_factor": (1 + 0.2 * _factors.random(n)).tolist(),
        "long_factor": np.geomspace(1, 8, n).tolist(),
        "original_max_position_embeddings": ORIGINAL,
    }


# Phi-3-mini-4k: plain RoPE; Phi-3.5-mini: LongRoPE; Phi-4-mini: LongRoPE on 3/4 of each head.
CASES = {
    "phi3": {},
    "phi3.5-longrope": dict(rope_parameters=longrope(16)),
    "phi4-longrope-partial": dict(
        rope_parameters=longrope(12) | {"partial_rotary_factor": 0.75}, tie_word_embeddings=True
    ),
}
for _case in CASES.values():  # Phi3Config's own field, which wins over rope_parameters'
    _case["original_max_position_embeddings"] = ORIGINAL


def random_phi3(**overrides) -> torch.nn.Module:
    # Phi3Config's token ids default to its 32k vocabulary's.
    ids = dict(pad_token_id=None, bos_token_id=1, eos_token_id=2)
    return _random_hf_model("Phi3", **ids, **overrides)


def tinyllm_dense(path: Path, context: int | None = None) -> Transformer:
    """fp32 weights, as LLM(quantization="none") loads a checkpoint; `context` is max_model_len.
    The loader reads a tokenizer too, which save_pretrained does not write: one is added."""
    _write_tokenizer(path)
    return load(path, max_model_len=context)


def prompts(*lengths: int, vocab: int = BASE["vocab_size"]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("case", CASES)
def test_phi3_checkpoint_matches_transformers(case: str, backend: str, tmp_path: Path) -> None:
    reference = random_phi3(**CASES[case])
    reference.save_pretrained(tmp_path)
    assert "model.layers.0.self_attn.qkv_proj.weight" in load_file(tmp_path / "model.safetensors")
    config = hf_config(tmp_path)
    assert config.architecture == "phi3"
    assert config.rotary_dim == (12 if "partial" in case else None)
    # Past the original context transformers uses the long factors, as tinyllm does for a
    # max_model_len past it; within it the short ones, as tinyllm does for a max_model_len
    # within it. (The plain case has no factors: both runs are the same model.)
    for context, lengths in ((None, (ORIGINAL + 4, 40)), (ORIGINAL, (5, ORIGINAL))):
        model = tinyllm_dense(tmp_path, context)
        batch = prompts(*lengths)
        ours = prompt_logits(model, batch, backend=backend)
        for prompt, logits in zip(batch, ours, strict=True):
            expected = transformers_logits(reference, prompt)
            assert expected.std() > 0.3
            torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_long_and_short_factors_differ(tmp_path: Path) -> None:
    """The case above would pass with either set of factors if they made no difference."""
    random_phi3(**CASES["phi3.5-longrope"]).save_pretrained(tmp_path)
    (prompt,) = prompts(ORIGINAL + 4)
    (long,) = prompt_logits(tinyllm_dense(tmp_path), [prompt])
    (short,) = prompt_logits(tinyllm_dense(tmp_path, ORIGINAL), [prompt])
    assert (long - short).abs().max() > 0.1


def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(transformers_logits(model, ids)[-1].argmax()))
    return ids[len(prompt) :]


def test_llm_picks_longrope_factors_by_max_model_len(tmp_path: Path) -> None:
    """LLM runs a Phi-3.5-like checkpoint end to end: with a max_model_len past the original
    context, the long factors on every token (transformers' choice for a sequence that long);
    within it, the short ones."""
    from tinyllm import LLM, SamplingParams

    reference = random_phi3(**CASES["phi4-longrope-partial"])
    reference.save_pretrained(tmp_path)
    _write_tokenizer(tmp_path)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    short_prompt, long_prompt = prompts(5, ORIGINAL + 2)
    for max_len, prompt in ((ORIGINAL + 32, long_prompt), (ORIGINAL, short_prompt)):
        llm = LLM(str(tmp_path), "float32", quantization="none", max_model_len=max_len)
        (out,) = llm.generate(prompt, greedy, use_tqdm=False)
        assert list(out.outputs[0].token_ids) == hf_greedy(reference, prompt, 6), max_len


def test_phi3_sliding_window_caps_the_context(tmp_path: Path, caplog) -> None:
    """Phi-3-mini-4k's window (2047 of 4096) is shorter than its context: tinyllm serves up to
    the window, where full attention and the window agree."""
    reference = random_phi3(sliding_window=8)
    reference.save_pretrained(tmp_path)
    with caplog.at_level(logging.WARNING, logger="tinyllm.model.config"):
        config = hf_config(tmp_path)
    assert config.max_position_embeddings == 8
    assert "sliding_window=8" in caplog.text and "at most 8 tokens" in caplog.text
    (prompt,) = prompts(8)
    (ours,) = prompt_logits(tinyllm_dense(tmp_path), [prompt])
    torch.testing.assert_close(ours, transformers_logits(reference, prompt), atol=1e-4, rtol=1e-4)
    # A window at least the context changes nothing (Phi-3.5-mini's is 262144 of 131072).
    random_phi3(sliding_window=BASE["max_position_embeddings"]).save_pretrained(tmp_path / "wide")
    wide = hf_config(tmp_path / "wide")
    assert wide.max_position_embeddings == BASE["max_position_embeddings"]


def test_longrope_config_errors_name_the_field(tmp_path: Path) -> None:
    random_phi3(**CASES["phi3.5-longrope"]).save_pretrained(tmp_path)
    cfg = (tmp_path / "config.json").read_text()
    (tmp_path / "config.json").write_text(cfg.replace('"short_factor"', '"shortish"'))
    with pytest.raises(ModelLoadError, match="longrope rope scaling lacks 'short_factor'"):
        hf_config(tmp_path)
    random_phi3(**CASES["phi4-longrope-partial"]).save_pretrained(tmp_path / "p")
    cfg = (tmp_path / "p" / "config.json").read_text()
    (tmp_path / "p" / "config.json").write_text(
        cfg.replace('"partial_rotary_factor": 0.75', '"partial_rotary_factor": 0.5')
    )
    with pytest.raises(
        ModelLoadError, match="longrope short_factor has 6 values; 8 rotated dims need 4"
    ):
        hf_config(tmp_path / "p")


# ---- Phi-3 GGUF files, as llama.cpp's converter writes them ----

GGUF_DIMS = dict(vocab_size=128, intermediate_size=256, max_position_embeddings=256)


def phi3_gguf(path: Path, reference: torch.nn.Module, qtype: Q = Q.F32) -> Path:
    """`reference`'s weights as a GGUF file of architecture phi3 (test_gguf_loader's dims)."""
    config = reference.config
    weights = {k: v.numpy() for k, v in reference.state_dict().items()}
    if config.tie_word_embeddings:
        del weights["lm_head.weight"]
    # transformers' GGUF loader otherwise takes Phi3Config's pad id, outside this vocabulary.
    rope, metadata, factors = config.rope_parameters, {"tokenizer.ggml.padding_token_id": 0}, {}
    partial = rope.get("partial_rotary_factor", 1.0)
    if partial != 1:
        metadata["phi3.rope.dimension_count"] = int(16 * partial)
    if rope["rope_type"] == "longrope":
        metadata["phi3.rope.scaling.original_context_length"] = ORIGINAL
        metadata["phi3.rope.scaling.attn_factor"] = reference.model.rotary_emb.attention_scaling
        for kind in ("short", "long"):
            factors[f"rope_factors_{kind}.weight"] = np.array(rope[f"{kind}_factor"], np.float32)
    return write_gguf(path, weights, "phi3", qtype, metadata, extra_tensors=factors)


@pytest.mark.parametrize("case", ["phi3", "phi4-longrope-partial"])
def test_phi3_gguf_matches_transformers(case: str, tmp_path: Path) -> None:
    reference = random_phi3(**CASES[case], **GGUF_DIMS)
    path = phi3_gguf(tmp_path / "m.gguf", reference)
    checkpoint = open_checkpoint(str(path))
    config = checkpoint.config
    assert config.architecture == "phi3" and checkpoint.tensors.keys() >= {
        "model.layers.1.self_attn.qkv_proj.weight",
        "model.layers.1.mlp.gate_up_proj.weight",
    }
    if case != "phi3":
        assert config.rotary_dim == 12
        attention_factor = reference.model.rotary_emb.attention_scaling
        assert config.rope_scaling["attention_factor"] == pytest.approx(attention_factor)
    model = load(path)
    # Both past the original context: the long factors, as the file's context (256) picks.
    batch = prompts(ORIGINAL + 4, ORIGINAL + 9, vocab=GGUF_DIMS["vocab_size"])
    for prompt, logits in zip(batch, prompt_logits(model, batch), strict=True):
        expected = transformers_logits(reference, prompt)
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("window", [0, 8, 256])
def test_phi3_gguf_sliding_window(window: int, tmp_path: Path) -> None:
    """llama.cpp's converter writes 0 for a Phi-3 without a window; a window shorter than the
    file's context (256) cuts the context to it, as from a checkpoint."""
    metadata = {"phi3.attention.sliding_window": window}
    path = write_gguf(tmp_path / "m.gguf", {}, "phi3", metadata=metadata)  # metadata only
    assert gguf_config(open_gguf(path)).max_position_embeddings == (window or 256)


def test_phi3_gguf_weights_are_what_transformers_reads(tmp_path: Path) -> None:
    """The stacked tensors of a Q4_0 file, dequantized, under the names and in the row order
    that transformers' own GGUF loader gives them."""
    from transformers import AutoModelForCausalLM

    path = phi3_gguf(tmp_path / "m.gguf", random_phi3(**GGUF_DIMS), Q.Q4_0)
    expected = AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32
    ).state_dict()
    weights = checkpoint_weights(load(path), split=False)
    assert weights.keys() == expected.keys()
    for name, w in weights.items():
        torch.testing.assert_close(w, expected[name], atol=1e-6, rtol=0, msg=name)


@pytest.mark.parametrize("case", ["phi3", "phi4-longrope-partial"])
def test_phi3_q4_0_gguf_runs_as_stored(case: str, tmp_path: Path) -> None:
    """The default path for a 4-bit file (int4 kernels, the stacked projections packed as
    stored, on the fused C++ layer) against transformers running the file's weights."""
    reference = random_phi3(**CASES[case], **GGUF_DIMS)
    path = phi3_gguf(tmp_path / "m.gguf", reference, Q.Q4_0)
    dequantized = checkpoint_weights(load(path), split=False)
    missing, _ = reference.load_state_dict(dequantized, strict=False)
    assert missing == (["lm_head.weight"] if "partial" in case else [])  # tied to the embeddings
    model = tinyllm_model(path)
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.bits == 4 and layer.mlp.gate_up_proj.bits == 4
    batch = prompts(ORIGINAL + 4, ORIGINAL + 9, vocab=GGUF_DIMS["vocab_size"])
    for prompt, logits in zip(batch, prompt_logits(model, batch), strict=True):
        expected = transformers_logits(reference, prompt)
        # Only the activations' rounding to 8 bits differs: at most 0.6% of the logits' spread
        # measured; a wrong rotation or a swapped gate and up moves them by whole units.
        torch.testing.assert_close(logits, expected, rtol=0, atol=0.01 * expected.std().item())
        assert logits.argmax(-1).equal(expected.argmax(-1))


# ---- families tinyllm refuses: one line, naming the architecture and why ----

# HF class -> what the message says it has (and, for GGUF, the file's general.architecture).
REFUSED = {
    "GemmaForCausalLM": "(1 + weight) RMSNorms",
    "PhiForCausalLM": "attention and MLP in parallel",
    "GPT2LMHeadModel": None,
}


@pytest.mark.parametrize("cls", REFUSED)
def test_refused_checkpoint_names_its_architecture(cls: str, tmp_path: Path) -> None:
    model_type = getattr(transformers, cls).config_class.model_type  # as save_pretrained writes
    (tmp_path / "config.json").write_text(
        json.dumps({**BASE, "architectures": [cls], "model_type": model_type})
    )
    with pytest.raises(UnsupportedModelError) as error:
        hf_config(tmp_path)
    (line,) = str(error.value).splitlines()
    assert line.startswith(f"{cls} (model_type {model_type!r}) is not supported")
    assert (REFUSED[cls] or "not supported; tinyllm runs llama,") in line
    assert "phi3" in line  # what tinyllm does run


@pytest.mark.parametrize("arch", ["gemma", "phi2", "gpt2"])
def test_refused_gguf_names_its_architecture(arch: str, tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", {}, arch)
    with pytest.raises(UnsupportedModelError) as error:
        gguf_config(open_gguf(path))
    (line,) = str(error.value).splitlines()
    assert f"{path}: GGUF architecture {arch!r} is not supported" in line
    assert ("gemma" in arch or arch == "phi2") == ("it needs" in line), line


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_refused_model_is_one_line_from_the_cli(source: str, tmp_path: Path, capsys) -> None:
    if source == "gguf":
        path = write_gguf(tmp_path / "m.gguf", {}, "gemma")
    else:
        config = {**BASE, "architectures": ["GemmaForCausalLM"], "model_type": "gemma"}
        (tmp_path / "config.json").write_text(json.dumps(config))
        path = tmp_path
    assert cli.main(["generate", "hi", "--model", str(path)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("tinyllm: error:")]
    assert "is not supported: it needs Gemma 1's layers: (1 + weight) RMSNorms" in line, err


def test_phi3_configs_of_either_layout_agree(tmp_path: Path) -> None:
    """Phi-3-mini-128k and Phi-4-mini's own config.json files (rope_scaling of type "su" or
    "longrope", the pretrained context and partial_rotary_factor beside it) read as the
    rope_parameters transformers 5 writes do."""
    random_phi3(**CASES["phi4-longrope-partial"]).save_pretrained(tmp_path / "new")
    new = json.loads((tmp_path / "new" / "config.json").read_text())
    params = new.pop("rope_parameters")
    old = new | {
        "rope_theta": params["rope_theta"],
        "partial_rotary_factor": params["partial_rotary_factor"],
        "rope_scaling": {"type": "su"} | {k: params[k] for k in ("short_factor", "long_factor")},
    }
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "config.json").write_text(json.dumps(old))
    assert hf_config(tmp_path / "old") == hf_config(tmp_path / "new")
    assert hf_config(tmp_path / "old").rope_scaling["rope_type"] == "longrope"


def test_every_supported_architecture_has_its_model_class():
    """The loader builds each supported architecture through model/families.py: none missing,
    none that the config would refuse."""
    from tinyllm.model.config import SUPPORTED_ARCHITECTURES
    from tinyllm.model.families import MODEL_CLASSES

    assert sorted(MODEL_CLASSES) == sorted(SUPPORTED_ARCHITECTURES)
